package k8stest

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/rlagent/rlagent/internal/testenv"
)

// How long a server may take to become ready, and to stop after SIGTERM.
// /readyz normally answers in ~4 s and etcd in ~1 s; the margin is for a
// machine busy compiling the other test packages of `go test ./...`.
const (
	readyTimeout = 90 * time.Second
	stopGrace    = 10 * time.Second
)

// ServiceClusterIPRange is the range the API server allocates ClusterIPs from.
const ServiceClusterIPRange = "10.96.0.0/16"

// Env is one running etcd and kube-apiserver on 127.0.0.1. A bare API server
// runs no controllers: nothing creates EndpointSlices for Services, scales
// Pods for Deployments or finishes deleting a Namespace; tests create the
// objects they need directly.
type Env struct {
	// Config reaches the API server as an admin (group system:masters), with
	// client-side rate limiting raised for tests. Copy it with rest.CopyConfig
	// before changing it.
	Config *rest.Config
	// Kubeconfig is the path of a kubeconfig file with the same credentials
	// (token auth, the server's self-signed CA), for programs under test.
	Kubeconfig string
	// Dir holds the servers' data, certificates and logs (etcd.log,
	// kube-apiserver.log). It is removed when the Env stops.
	Dir string

	logf          func(string, ...any)
	clientset     kubernetes.Interface
	apiserverPath string
	apiserverArgs []string
	url           string // https://127.0.0.1:<port>

	wrap  []string // prefix of the servers' command lines (serverOptions)
	dial  func(ctx context.Context, network, addr string) (net.Conn, error)
	saKey string // the service-account signing key (StartNode's controller-manager)

	mu        sync.Mutex // guards the processes against concurrent Stop/Start
	etcd      *process
	apiserver *process
}

// Start runs an etcd and a kube-apiserver for tb, ready to serve, and stops
// them and removes their files when tb ends. It skips tb when the binaries
// cannot be built (fails it with RLAGENT_REQUIRE_ROOT_TESTS=1).
func Start(tb testing.TB) *Env {
	tb.Helper()
	apiserver, etcd, err := ensureBinaries(tb)
	if err != nil {
		testenv.SkipOrFail(tb, "no kube-apiserver and etcd to test against: %v", err)
		return nil
	}
	// Registered before the cleanup below, so it runs after it: the servers
	// stop before their directory goes.
	dir := tb.TempDir()
	e, err := start(apiserver, etcd, dir, tb.Logf, serverOptions{})
	if err != nil {
		tb.Fatalf("start etcd and kube-apiserver: %v", err)
	}
	tb.Cleanup(func() {
		if tb.Failed() {
			tb.Logf("k8stest: the servers' output, for the failure above:\n%s", e.logs(100))
		}
		if err := e.stop(); err != nil {
			tb.Errorf("k8stest: %v", err)
		}
	})
	return e
}

// shared is the Env that Shared hands out, one per test binary.
var shared struct {
	running bool // RunShared is running the tests
	once    sync.Once
	env     *Env
	err     error
	skip    bool // err is from EnsureBinaries: skip, not fail
	dir     string
}

// RunShared runs the tests of a package whose tests call Shared, and then
// stops the shared Env if one was started. Call it from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(k8stest.RunShared(m)) }
func RunShared(m *testing.M) int {
	shared.running = true
	code := m.Run()
	if e := shared.env; e != nil {
		if code != 0 {
			fmt.Fprintf(os.Stderr, "k8stest: the shared servers' output, for the failures above:\n%s\n", e.logs(100))
		}
		if err := e.stop(); err != nil {
			fmt.Fprintf(os.Stderr, "k8stest: %v\n", err)
			if code == 0 {
				code = 1
			}
		}
	}
	if shared.dir != "" {
		os.RemoveAll(shared.dir)
	}
	return code
}

// Shared returns the test binary's shared Env, starting it on the first call.
// The package's TestMain must run the tests with RunShared, which stops it.
// Tests that share it keep apart by namespace (Env.Namespace) and must not
// stop the API server; a test that does uses its own Start.
func Shared(tb testing.TB) *Env {
	tb.Helper()
	if !shared.running {
		tb.Fatal("k8stest.Shared: the package's TestMain must call os.Exit(k8stest.RunShared(m)), which stops the shared servers")
	}
	shared.once.Do(func() {
		apiserver, etcd, err := ensureBinaries(tb)
		if err != nil {
			shared.err, shared.skip = err, true
			return
		}
		shared.dir, err = os.MkdirTemp("", "k8stest-")
		if err != nil {
			shared.err = err
			return
		}
		shared.env, shared.err = start(apiserver, etcd, shared.dir, tb.Logf, serverOptions{})
		if shared.env != nil {
			// tb ends long before the Env; logging to it later would panic.
			shared.env.logf = func(string, ...any) {}
		}
	})
	switch {
	case shared.skip:
		testenv.SkipOrFail(tb, "no kube-apiserver and etcd to test against: %v", shared.err)
	case shared.err != nil:
		tb.Fatalf("start the shared etcd and kube-apiserver: %v", shared.err)
	}
	return shared.env
}

// ensureBinaries is EnsureBinaries for a test, with a hint for when the
// build would not fit in go test's default 10 min timeout.
func ensureBinaries(tb testing.TB) (apiserver, etcd string, err error) {
	if dir, err := CacheDir(); err == nil && !cached(filepath.Join(dir, apiserverBinary), filepath.Join(dir, etcdBinary)) {
		tb.Logf("k8stest: kube-apiserver and etcd are not in %s yet; if go test times out while building them, "+
			"run `go run ./internal/k8stest/k8sbin` (or `make test-k8s`) first, or pass -timeout 30m", dir)
	}
	// Not tb.Context(): a shared Env outlives the test that starts it, and a
	// build cut short helps nobody (go test's -timeout still applies).
	return EnsureBinaries(context.Background(), tb.Logf)
}

// start runs etcd and kube-apiserver with their files in dir and waits until
// the API server is ready. On error nothing is left running.
// serverOptions are how start runs the servers. The zero value: on the
// host's loopback, for the Kubernetes tests without a node.
type serverOptions struct {
	// wrap prefixes every server's command line (StartNode: nsenter into
	// the node's namespaces).
	wrap []string
	// addr, if set, is the address the API server listens on and
	// advertises as the endpoint of the Service default/kubernetes (the
	// node's), with etcd on the loopback of the same network namespace and
	// fixed ports (the namespace is the test's own).
	addr string
	// dial reaches addr from the test (into the node's network namespace).
	dial func(ctx context.Context, network, addr string) (net.Conn, error)
}

func start(apiserverPath, etcdPath, dir string, logf func(string, ...any), so serverOptions) (_ *Env, err error) {
	began := time.Now()
	var etcdClient, etcdPeer, apiPort int
	if so.addr == "" {
		ports, err := freePorts(3)
		if err != nil {
			return nil, err
		}
		etcdClient, etcdPeer, apiPort = ports[0], ports[1], ports[2]
	} else {
		etcdClient, etcdPeer, apiPort = 2379, 2380, 6443
	}
	e := &Env{Dir: dir, logf: logf, apiserverPath: apiserverPath, wrap: so.wrap, dial: so.dial}
	defer func() {
		if err != nil {
			err = fmt.Errorf("%w\n%s", err, e.logs(40))
			e.stop()
		}
	}()

	clientURL := "http://127.0.0.1:" + strconv.Itoa(etcdClient)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(etcdPeer)
	e.etcd, err = e.startProcess("etcd", filepath.Join(dir, "etcd.log"), etcdPath,
		"--name=k8stest",
		"--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+clientURL,
		"--advertise-client-urls="+clientURL,
		"--listen-peer-urls="+peerURL,
		"--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=k8stest="+peerURL,
		// The data dies with the test: durability only costs time.
		"--unsafe-no-fsync",
	)
	if err != nil {
		return e, err
	}
	if err := waitHTTP(e.etcd, &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DialContext: e.dialer()}},
		clientURL+"/health", "", readyTimeout); err != nil {
		return e, err
	}
	etcdReady := time.Since(began)

	token, err := randomHex(16)
	if err != nil {
		return e, err
	}
	tokens := filepath.Join(dir, "tokens.csv")
	if err := os.WriteFile(tokens, []byte(token+`,admin,admin,"system:masters"`+"\n"), 0o600); err != nil {
		return e, err
	}
	saKey, saPub, err := writeServiceAccountKeys(dir)
	if err != nil {
		return e, err
	}
	certDir := filepath.Join(dir, "apiserver-certs")
	host := "127.0.0.1"
	if so.addr != "" {
		host = so.addr
	}
	e.url = "https://" + net.JoinHostPort(host, strconv.Itoa(apiPort))
	e.apiserverArgs = []string{
		"--etcd-servers=" + clientURL,
		"--bind-address=" + host,
		"--advertise-address=" + host,
		"--secure-port=" + strconv.Itoa(apiPort),
		// Without --tls-cert-file it makes a self-signed CA and serving
		// certificate here, and reuses them on restart.
		"--cert-dir=" + certDir,
		"--token-auth-file=" + tokens,
		"--authorization-mode=RBAC",
		"--service-account-key-file=" + saPub,
		"--service-account-signing-key-file=" + saKey,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-cluster-ip-range=" + ServiceClusterIPRange,
		"--allow-privileged=true",
		// Without it an open watch (any informer) holds SIGTERM up for the
		// HTTP server's 60 s shutdown timeout; with it the server drains
		// watches for at most this long and exits in ~1 s.
		"--shutdown-watch-termination-grace-period=2s",
	}
	if so.addr == "" {
		e.apiserverArgs = append(e.apiserverArgs,
			// The default reconciler would publish 127.0.0.1 as the kubernetes
			// Service's endpoint and complain about a loopback address.
			"--endpoint-reconciler-type=none",
			// Nothing creates the default ServiceAccount without the controllers.
			"--disable-admission-plugins=ServiceAccount")
	} else {
		// A node's pods reach the API server through the kubernetes
		// Service (kube-proxy), and get service-account tokens.
		e.apiserverArgs = append(e.apiserverArgs, "--kubelet-preferred-address-types=InternalIP")
	}
	e.saKey = saKey
	if err := e.startAPIServer(token); err != nil {
		return e, err
	}

	ca, err := os.ReadFile(filepath.Join(certDir, "apiserver.crt"))
	if err != nil {
		return e, fmt.Errorf("read the API server's self-signed certificate: %w", err)
	}
	e.Config = &rest.Config{
		Host:            e.url,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: ca},
		// client-go's default of 5 QPS, burst 10, would throttle tests that
		// write many objects; here the server is ours alone.
		QPS:   1000,
		Burst: 2000,
		Dial:  so.dial,
	}
	if e.clientset, err = kubernetes.NewForConfig(e.Config); err != nil {
		return e, err
	}
	// Proves the CA and the token before a test trips over them.
	if _, err := e.clientset.Discovery().ServerVersion(); err != nil {
		return e, fmt.Errorf("reach the API server with the generated config: %w", err)
	}
	e.Kubeconfig = filepath.Join(dir, "kubeconfig")
	if err := writeKubeconfig(e.Kubeconfig, e.url, ca, token); err != nil {
		return e, err
	}
	logf("k8stest: etcd ready in %s, kube-apiserver %s ready at %s in %s",
		etcdReady.Round(time.Millisecond), KubernetesVersion, e.url, time.Since(began).Round(time.Millisecond))
	return e, nil
}

// startAPIServer runs kube-apiserver with e's arguments and waits for /readyz.
func (e *Env) startAPIServer(token string) error {
	var err error
	e.apiserver, err = e.startProcess("kube-apiserver", filepath.Join(e.Dir, "kube-apiserver.log"), e.apiserverPath, e.apiserverArgs...)
	if err != nil {
		return err
	}
	// The CA is not known until the server has written it.
	insecure := &http.Client{
		Timeout:   2 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, DialContext: e.dialer()},
	}
	return waitHTTP(e.apiserver, insecure, e.url+"/readyz", token, readyTimeout)
}

// Clientset returns a clientset for e.Config.
func (e *Env) Clientset() kubernetes.Interface { return e.clientset }

// StopAPIServer stops kube-apiserver (SIGTERM, then SIGKILL), leaving etcd
// and the data running, so that requests fail until StartAPIServer.
func (e *Env) StopAPIServer() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.apiserver == nil {
		return errors.New("kube-apiserver is not running")
	}
	began := time.Now()
	killed, err := e.apiserver.stop(stopGrace)
	if err != nil {
		return err
	}
	e.apiserver = nil
	how := "SIGTERM"
	if killed {
		how = "SIGKILL after ignoring SIGTERM for " + stopGrace.String()
	}
	e.logf("k8stest: kube-apiserver stopped (%s) in %s", how, time.Since(began).Round(time.Millisecond))
	return nil
}

// StartAPIServer starts kube-apiserver again after StopAPIServer, on the same
// address and with the same etcd, certificates and credentials, and waits
// until it is ready.
func (e *Env) StartAPIServer() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.apiserver != nil {
		return errors.New("kube-apiserver is already running")
	}
	began := time.Now()
	if err := e.startAPIServer(e.Config.BearerToken); err != nil {
		if e.apiserver != nil {
			e.apiserver.stop(stopGrace)
			e.apiserver = nil
		}
		return fmt.Errorf("%w\n%s", err, tail(filepath.Join(e.Dir, "kube-apiserver.log"), 40))
	}
	e.logf("k8stest: kube-apiserver restarted at %s in %s", e.url, time.Since(began).Round(time.Millisecond))
	return nil
}

// Namespace creates a namespace with a generated name for tb and returns the
// name. It is not deleted: without kube-controller-manager a deleted namespace
// stays Terminating forever, and the data goes with the Env anyway.
func (e *Env) Namespace(tb testing.TB) string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(tb.Context(), 30*time.Second)
	defer cancel()
	ns, err := e.clientset.CoreV1().Namespaces().Create(ctx,
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "test-"}}, metav1.CreateOptions{})
	if err != nil {
		tb.Fatalf("create namespace: %v", err)
	}
	return ns.Name
}

// stop stops both servers, the API server first.
func (e *Env) stop() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	var errs []error
	for _, p := range []**process{&e.apiserver, &e.etcd} {
		if *p == nil {
			continue
		}
		if _, err := (*p).stop(stopGrace); err != nil {
			errs = append(errs, err)
		}
		*p = nil
	}
	return errors.Join(errs...)
}

// logs returns the last n lines of each server's output.
func (e *Env) logs(n int) string {
	var s string
	for _, name := range []string{"etcd", "kube-apiserver"} {
		path := filepath.Join(e.Dir, name+".log")
		if _, err := os.Stat(path); err != nil {
			continue
		}
		s += fmt.Sprintf("--- %s ---\n%s\n", name, tail(path, n))
	}
	return s
}

// waitHTTP polls url until it answers 200 OK, p exits or timeout passes.
func waitHTTP(p *process, client *http.Client, url, token string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		if done, err := p.exited(); done {
			return fmt.Errorf("%s exited while starting (%v); log %s", p.name, err, p.logPath)
		}
		req, err := http.NewRequest(http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		last = err
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %s: %w", p.name, timeout, last)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// freePorts returns n distinct free TCP ports on 127.0.0.1. They are free
// when it returns; nothing stops another process from taking one before the
// server binds it, but the kernel hands out ephemeral ports at random.
func freePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("find a free port: %w", err)
		}
		defer l.Close() // held until all are chosen, so they differ
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// writeServiceAccountKeys writes an RSA key pair for signing and verifying
// service account tokens into dir and returns the two paths.
func writeServiceAccountKeys(dir string) (key, pub string, err error) {
	k, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return "", "", err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(&k.PublicKey)
	if err != nil {
		return "", "", err
	}
	key, pub = filepath.Join(dir, "sa.key"), filepath.Join(dir, "sa.pub")
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(k)})
	pubPEM := pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER})
	if err := os.WriteFile(key, keyPEM, 0o600); err != nil {
		return "", "", err
	}
	if err := os.WriteFile(pub, pubPEM, 0o644); err != nil {
		return "", "", err
	}
	return key, pub, nil
}

// writeKubeconfig writes a kubeconfig for server with token auth.
func writeKubeconfig(path, server string, ca []byte, token string) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["k8stest"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: ca}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["k8stest"] = &clientcmdapi.Context{Cluster: "k8stest", AuthInfo: "admin", Namespace: corev1.NamespaceDefault}
	cfg.CurrentContext = "k8stest"
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	return nil
}

func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

// PIDs returns the process IDs of the running kube-apiserver and etcd (0
// for one that is stopped), for tests that measure their CPU and memory.
func (e *Env) PIDs() (apiserver, etcd int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	pid := func(p *process) int {
		if p == nil {
			return 0
		}
		if done, _ := p.exited(); done {
			return 0
		}
		return p.cmd.Process.Pid
	}
	return pid(e.apiserver), pid(e.etcd)
}

// startProcess starts a server, through e's wrapper.
func (e *Env) startProcess(name, logPath, path string, args ...string) (*process, error) {
	if len(e.wrap) > 0 {
		args = append(append(append([]string{}, e.wrap[1:]...), path), args...)
		path = e.wrap[0]
	}
	return startProcess(name, logPath, path, args...)
}

// dialer is how the test reaches the servers.
func (e *Env) dialer() func(ctx context.Context, network, addr string) (net.Conn, error) {
	if e.dial != nil {
		return e.dial
	}
	return (&net.Dialer{}).DialContext
}

// SetDaemonSetStatus writes a DaemonSet's status.numberReady and
// desiredNumberScheduled as the DaemonSet controller would (an Env runs no
// controllers), creating the DaemonSet first if needed: the nodes scope's
// count, for tests that simulate the agents.
func (e *Env) SetDaemonSetStatus(tb testing.TB, ns, name string, ready, desired int) {
	tb.Helper()
	ctx := context.Background()
	dss := e.clientset.AppsV1().DaemonSets(ns)
	ds, err := dss.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		labels := map[string]string{"app": name}
		ds, err = dss.Create(ctx, &appsv1.DaemonSet{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: appsv1.DaemonSetSpec{
				Selector: &metav1.LabelSelector{MatchLabels: labels},
				Template: corev1.PodTemplateSpec{
					ObjectMeta: metav1.ObjectMeta{Labels: labels},
					Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "agent", Image: "example.invalid/agent"}}},
				},
			},
		}, metav1.CreateOptions{})
	}
	if err != nil {
		tb.Fatalf("DaemonSet %s/%s: %v", ns, name, err)
	}
	ds.Status.NumberReady, ds.Status.DesiredNumberScheduled = int32(ready), int32(desired)
	ds.Status.CurrentNumberScheduled, ds.Status.NumberAvailable = int32(desired), int32(ready)
	if _, err := dss.UpdateStatus(ctx, ds, metav1.UpdateOptions{}); err != nil {
		tb.Fatalf("DaemonSet %s/%s: %d of %d ready: %v", ns, name, ready, desired, err)
	}
}
