package k8stest

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

func TestMain(m *testing.M) { os.Exit(RunShared(m)) }

// TestEnv walks through what the integration tests rely on: objects written
// with client-go arrive through an informer; while the API server is stopped
// requests fail and the informer keeps its last state; after a restart on the
// same address the data is still there and the informer's watch resumes; and
// the cleanup leaves no process or file behind.
func TestEnv(t *testing.T) {
	var (
		env  *Env
		pids []int
	)
	t.Run("lifecycle", func(t *testing.T) {
		env = Start(t)
		pids = testLifecycle(t, env)
	})
	if env == nil || t.Failed() {
		return
	}
	// The subtest's cleanup has run.
	for _, pid := range pids {
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("process %d still exists after cleanup (kill -0: %v)", pid, err)
		}
	}
	if _, err := os.Stat(env.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s still exists after cleanup (stat: %v)", env.Dir, err)
	}
}

// testLifecycle runs the scenario and returns the servers' PIDs.
func testLifecycle(t *testing.T, env *Env) (pids []int) {
	ctx := t.Context()
	cs := env.Clientset()

	// The kubeconfig file works on its own and the version was linked in.
	cfg, err := clientcmd.BuildConfigFromFlags("", env.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	fromFile, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	v, err := fromFile.Discovery().ServerVersion()
	if err != nil {
		t.Fatalf("server version through %s: %v", env.Kubeconfig, err)
	}
	if v.GitVersion != KubernetesVersion {
		t.Errorf("server version %q, want %q", v.GitVersion, KubernetesVersion)
	}

	ns := env.Namespace(t)
	svc, err := cs.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: corev1.ServiceSpec{
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolUDP}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create service: %v", err)
	}
	if svc.Spec.ClusterIP == "" {
		t.Errorf("service has no ClusterIP from %s", ServiceClusterIPRange)
	}

	// The informer starts before the slice exists, so the slice has to come
	// through the watch, not only the initial list.
	events := make(chan *discoveryv1.EndpointSlice, 16)
	factory := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithNamespace(ns))
	slices := factory.Discovery().V1().EndpointSlices()
	_, err = slices.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { events <- obj.(*discoveryv1.EndpointSlice) },
		UpdateFunc: func(_, obj any) { events <- obj.(*discoveryv1.EndpointSlice) },
	})
	if err != nil {
		t.Fatal(err)
	}
	factory.Start(ctx.Done())
	t.Cleanup(factory.Shutdown) // after the context is cancelled
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			t.Fatalf("informer for %v did not sync", typ)
		}
	}

	created, err := cs.DiscoveryV1().EndpointSlices(ns).Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:   "web-1",
			Labels: map[string]string{discoveryv1.LabelServiceName: svc.Name},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{
			endpoint("10.1.0.1", "node-a", true),
			endpoint("10.1.0.2", "node-b", false),
		},
		Ports: []discoveryv1.EndpointPort{{Name: to("http"), Port: to[int32](8080), Protocol: to(corev1.ProtocolUDP)}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create endpointslice: %v", err)
	}
	got := waitSlice(t, events, created.Name, created.ResourceVersion)
	if want := "10.1.0.1/node-a/ready,10.1.0.2/node-b/notready"; summary(got) != want {
		t.Errorf("informer got endpoints %s, want %s", summary(got), want)
	}
	if _, err := slices.Lister().EndpointSlices(ns).Get(created.Name); err != nil {
		t.Errorf("lister: %v", err)
	}

	if err := env.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	reqCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	_, err = cs.DiscoveryV1().EndpointSlices(ns).Get(reqCtx, created.Name, metav1.GetOptions{})
	cancel()
	if err == nil {
		t.Fatal("get endpointslice with the API server stopped: no error")
	}
	t.Logf("with the API server stopped: %v", err)
	if _, err := slices.Lister().EndpointSlices(ns).Get(created.Name); err != nil {
		t.Errorf("lister lost the slice while the API server is down: %v", err)
	}

	if err := env.StartAPIServer(); err != nil {
		t.Fatal(err)
	}
	after, err := cs.DiscoveryV1().EndpointSlices(ns).Get(ctx, created.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get endpointslice after the restart: %v", err)
	}
	if summary(after) != summary(created) || after.ResourceVersion != created.ResourceVersion {
		t.Errorf("after the restart the slice is %s at resourceVersion %s, want %s at %s",
			summary(after), after.ResourceVersion, summary(created), created.ResourceVersion)
	}

	// The informer's watch reconnects by itself and sees a change.
	after.Endpoints[1].Conditions.Ready = to(true)
	updated, err := cs.DiscoveryV1().EndpointSlices(ns).Update(ctx, after, metav1.UpdateOptions{})
	if err != nil {
		t.Fatalf("update endpointslice after the restart: %v", err)
	}
	got = waitSlice(t, events, updated.Name, updated.ResourceVersion)
	if want := "10.1.0.1/node-a/ready,10.1.0.2/node-b/ready"; summary(got) != want {
		t.Errorf("informer got endpoints %s after the restart, want %s", summary(got), want)
	}

	return []int{env.etcd.cmd.Process.Pid, env.apiserver.cmd.Process.Pid}
}

// TestShared checks that Shared hands every test the same running Env.
func TestShared(t *testing.T) {
	a := Shared(t)
	b := Shared(t)
	if a != b {
		t.Fatalf("Shared returned two Envs: %p and %p", a, b)
	}
	ns := a.Namespace(t)
	if _, err := b.Clientset().CoreV1().Namespaces().Get(t.Context(), ns, metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(a.Dir, os.TempDir()) {
		t.Errorf("shared Env in %s, want it under %s", a.Dir, os.TempDir())
	}
}

func TestCacheDir(t *testing.T) {
	t.Setenv(CacheEnv, "")
	t.Setenv("XDG_CACHE_HOME", "/xdg")
	if dir, err := CacheDir(); err != nil || dir != filepath.Join("/xdg/rlagent/k8s", KubernetesVersion) {
		t.Errorf("with XDG_CACHE_HOME: CacheDir() = %q, %v", dir, err)
	}
	t.Setenv(CacheEnv, "/override")
	if dir, err := CacheDir(); err != nil || dir != filepath.Join("/override", KubernetesVersion) {
		t.Errorf("with %s: CacheDir() = %q, %v", CacheEnv, dir, err)
	}
}

func endpoint(addr, node string, ready bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{
		Addresses:  []string{addr},
		NodeName:   to(node),
		Conditions: discoveryv1.EndpointConditions{Ready: to(ready)},
	}
}

// summary renders a slice's endpoints as address/node/readiness, for comparing.
func summary(s *discoveryv1.EndpointSlice) string {
	var parts []string
	for _, ep := range s.Endpoints {
		ready := "notready"
		if deref(ep.Conditions.Ready, false) {
			ready = "ready"
		}
		parts = append(parts, strings.Join(ep.Addresses, "+")+"/"+deref(ep.NodeName, "")+"/"+ready)
	}
	return strings.Join(parts, ",")
}

// waitSlice waits for the informer to deliver the named slice at resourceVersion.
func waitSlice(t *testing.T, events <-chan *discoveryv1.EndpointSlice, name, resourceVersion string) *discoveryv1.EndpointSlice {
	t.Helper()
	began := time.Now()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case s := <-events:
			if s.Name == name && s.ResourceVersion == resourceVersion {
				t.Logf("informer delivered %s at resourceVersion %s (waited %s)",
					name, resourceVersion, time.Since(began).Round(10*time.Microsecond))
				return s
			}
		case <-timeout:
			t.Fatalf("informer did not deliver %s at resourceVersion %s within 30 s", name, resourceVersion)
		}
	}
}

func to[T any](v T) *T { return &v }

func deref[T any](p *T, def T) T {
	if p == nil {
		return def
	}
	return *p
}
