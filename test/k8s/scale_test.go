package k8s

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/client/clientset/versioned"
	rlcluster "github.com/rlagent/rlagent/cluster"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/testenv"
	"github.com/rlagent/rlagent/watcher"
)

// The scale test's size: RLAGENT_SCALE_AGENTS simulated agents (default
// 300), RLAGENT_SCALE_SERVICES Services (default 10,000) of scaleEndpoints
// endpoints each, of which scaleReferenced are referenced by RateLimits.
// The defaults are the targets, and take about 90 s; make
// test-scale passes other sizes.
const (
	scaleEndpoints  = 10
	scaleReferenced = 100
	scaleNamespaces = 10
	scaleRepeats    = 5 // each kind of count change
)

func scaleSize(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}

// simAgent is one simulated agent: what a real agent runs against the API
// server (the Kubernetes source with its own client and informers, no
// shared cache, and its candidacy for the status writer), without a data
// path. It records when its observation of a limit first shows the
// expected count.
type simAgent struct {
	name string
	k    *watcher.Kubernetes
	w    *rlcluster.StatusWriter

	mu     sync.Mutex
	limit  string
	want   int
	seenAt time.Time
}

func (a *simAgent) expect(limit string, want int) {
	a.mu.Lock()
	a.limit, a.want, a.seenAt = limit, want, time.Time{}
	a.mu.Unlock()
	a.check()
}

func (a *simAgent) check() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.limit != "" && a.seenAt.IsZero() && a.k.Observe(a.limit).Replicas == a.want {
		a.seenAt = time.Now()
	}
}

func (a *simAgent) seen() time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.seenAt
}

func (a *simAgent) events() uint64 {
	var n uint64
	for _, s := range a.k.WatchStats() {
		n += s.Events
	}
	return n
}

// TestScale: simulated agents (each its own client and informers, as real
// agents have) in a cluster of many Services, of which RateLimits reference
// a few. Per count change it measures the watch events each agent receives,
// the API server's writes, and how long until every agent's count is right;
// and the API server's CPU and memory, and a real rlagent's memory. The
// targets (issue 11): <= 3 watch events per agent per count change whatever
// the cluster's size, <= 1 status write per change, every agent right within
// 1 s p99 at 300 agents, a real agent <= 64 MiB. docs/scale.md has the
// figures and what they extrapolate to.
func TestScale(t *testing.T) {
	testenv.RequireRoot(t) // the real agent
	nAgents := scaleSize(t, "RLAGENT_SCALE_AGENTS", 300)
	nServices := scaleSize(t, "RLAGENT_SCALE_SERVICES", 10000)
	env := k8stest.Start(t) // its own: the API server's CPU and memory are measured
	env.InstallCRD(t, deployDir+"/crd.yaml")
	apiPID, etcdPID := env.PIDs()
	ctx := t.Context()
	cs := env.Clientset()
	ns := env.Namespace(t)

	// The cluster: Services, one EndpointSlice each, endpoints spread over
	// the agents' nodes.
	created := time.Now()
	nsNames := make([]string, scaleNamespaces)
	for i := range nsNames {
		nsNames[i] = env.Namespace(t)
	}
	svcName := func(i int) (string, string) { return nsNames[i%scaleNamespaces], fmt.Sprintf("s%05d", i) }
	nodeName := func(i int) string { return fmt.Sprintf("node-%04d", i%nAgents) }
	parallel(t, nServices, 32, func(i int) error {
		sns, name := svcName(i)
		if _, err := cs.CoreV1().Services(sns).Create(ctx, &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone, Selector: map[string]string{"app": name},
				Ports: []corev1.ServicePort{{Name: "udp", Protocol: corev1.ProtocolUDP, Port: 5353}}},
		}, metav1.CreateOptions{}); err != nil {
			return err
		}
		_, err := cs.DiscoveryV1().EndpointSlices(sns).Create(ctx, scaleSlice(name, i, scaleEndpoints, nodeName), metav1.CreateOptions{})
		return err
	})
	t.Logf("created %d Services and %d endpoints in %d EndpointSlices in %v", nServices, nServices*scaleEndpoints, nServices,
		time.Since(created).Round(time.Millisecond))

	// The limits: one of scope nodes, and one of scope service for each
	// referenced Service.
	rl := dynamicClient(t, env).Resource(v1alpha1.RateLimitResource)
	const nodesLimit = "scale-nodes"
	createRateLimit(t, env, rateLimit(nodesLimit, map[string]any{"rate": 100000, "scope": "nodes", "match": map[string]any{"protocol": "udp"}}))
	for i := range scaleReferenced {
		sns, name := svcName(i)
		createRateLimit(t, env, rateLimit("scale-"+name, map[string]any{"rate": 100000, "scope": "service",
			"match": map[string]any{"service": sns + "/" + name, "protocol": "udp"}}))
	}
	setDaemonSetReady(t, env, ns, agentDaemonSet, nAgents, nAgents)

	// The agents.
	apiRSS0 := rssMiB(t, apiPID)
	started := time.Now()
	agents := make([]*simAgent, nAgents)
	var wg sync.WaitGroup
	sctx, stop := context.WithCancel(context.Background())
	t.Cleanup(func() { stop(); wg.Wait() })
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	for i := range agents {
		cfg := rest.CopyConfig(env.Config)
		cfg.QPS, cfg.Burst = 5, 10 // client-go's defaults, as the agent has them
		a := &simAgent{name: fmt.Sprintf("node-%04d", i)}
		a.k = watcher.NewKubernetes(watcher.KubernetesConfig{
			Client: kubernetes.NewForConfigOrDie(cfg), RateLimits: versioned.NewForConfigOrDie(cfg),
			NodeName: a.name, AgentNamespace: ns, AgentDaemonSet: agentDaemonSet, Log: quiet,
		})
		a.k.OnChange(a.check)
		a.w = rlcluster.NewStatusWriter(a.k, rlcluster.StatusConfig{Identity: a.name, Log: quiet})
		agents[i] = a
		wg.Go(func() { a.k.Run(sctx, func() {}) })
		wg.Go(func() { a.w.Run(sctx) })
	}
	for _, a := range agents {
		waitFor(t, 5*time.Minute, a.name+"'s caches to sync", func() (bool, string) { return a.k.Synced(), "" })
	}
	t.Logf("%d agents synced in %v", nAgents, time.Since(started).Round(time.Millisecond))
	var listed uint64
	for _, s := range agents[0].k.WatchStats() {
		listed += s.Listed
	}
	t.Logf("one agent's first lists: %d objects (%+v)", listed, agents[0].k.WatchStats())
	if sl := agents[0].k.WatchStats()["endpointslices"].Listed; sl != scaleReferenced {
		t.Errorf("an agent listed %d EndpointSlices, want the %d of the referenced Services (of %d)", sl, scaleReferenced, nServices)
	}
	waitFor(t, time.Minute, "one status writer", func() (bool, string) {
		n := 0
		for _, a := range agents {
			if a.w.Leading() {
				n++
			}
		}
		return n == 1, fmt.Sprintf("%d writers", n)
	})

	// A real agent in the same cluster, for its memory.
	real := startCluster(t, env, ns, 1)
	realPID := real.nodes[0].agent.PID()

	// Status writes of RateLimits, as a watch sees them.
	var statusWrites atomic.Int64
	wrl, err := rl.Watch(ctx, metav1.ListOptions{ResourceVersion: "0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(wrl.Stop)
	go func() {
		for ev := range wrl.ResultChan() {
			if ev.Type == watch.Modified {
				statusWrites.Add(1)
			}
		}
	}()
	// The writer's first round: every RateLimit's status written (at the
	// agent's client rate, 5 writes/s, this takes a while).
	firstRound := time.Now()
	waitFor(t, 3*time.Minute, "every RateLimit's status", func() (bool, string) {
		list, err := rl.List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		missing := 0
		for _, obj := range list.Items {
			gen, _, _ := unstructured.NestedInt64(obj.Object, "status", "observedGeneration")
			if c := condition(&obj, v1alpha1.ConditionAccepted); c == nil || gen != obj.GetGeneration() {
				missing++
			}
		}
		return missing == 0, fmt.Sprintf("%d of %d without status", missing, len(list.Items))
	})
	t.Logf("the writer's first round: %d RateLimits' status in %v", scaleReferenced+1, time.Since(firstRound).Round(time.Millisecond))
	time.Sleep(time.Second)

	type result struct {
		what      string
		latencies []time.Duration
		events    []uint64 // per agent, per change
		writes    []int64  // RateLimit status writes per change
		apiWrites []map[string]float64
	}
	cpu0, _ := cpuTicks(apiPID)
	etcdCPU0, _ := cpuTicks(etcdPID)
	measureStart := time.Now()
	measure := func(what, limit string, want func(rep int) int, change func(rep int)) result {
		r := result{what: what}
		for rep := range scaleRepeats {
			w := want(rep)
			for _, a := range agents {
				a.expect(limit, w)
			}
			ev0 := make([]uint64, len(agents))
			for i, a := range agents {
				ev0[i] = a.events()
			}
			writes0 := statusWrites.Load()
			api0 := apiWrites(t, env)
			t0 := time.Now()
			change(rep)
			for _, a := range agents {
				if limit == "" {
					break
				}
				waitFor(t, time.Minute, a.name+" to see the change", func() (bool, string) {
					return !a.seen().IsZero(), fmt.Sprintf("%+v, want %d", a.k.Observe(limit), w)
				})
				r.latencies = append(r.latencies, a.seen().Sub(t0))
			}
			time.Sleep(2 * time.Second) // the status write, and its events
			for i, a := range agents {
				r.events = append(r.events, a.events()-ev0[i])
			}
			r.writes = append(r.writes, statusWrites.Load()-writes0)
			r.apiWrites = append(r.apiWrites, subMetrics(apiWrites(t, env), api0))
		}
		return r
	}
	// setEndpoints gives Service i n ready endpoints.
	setEndpoints := func(i, n int) {
		sns, name := svcName(i)
		s := scaleSlice(name, i, n, nodeName)
		cur, err := cs.DiscoveryV1().EndpointSlices(sns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		s.ResourceVersion = cur.ResourceVersion
		if _, err := cs.DiscoveryV1().EndpointSlices(sns).Update(ctx, s, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	var results []result
	// Scope nodes: the DaemonSet's ready count.
	results = append(results, measure("agents' DaemonSet numberReady", nodesLimit,
		func(rep int) int { return nAgents - 1 - rep },
		func(rep int) { setDaemonSetReady(t, env, ns, agentDaemonSet, nAgents-1-rep, nAgents) }))
	// Scope service: one referenced Service loses an endpoint.
	_, svc7 := svcName(7)
	results = append(results, measure("a referenced Service's slice", "scale-"+svc7,
		func(rep int) int { return scaleEndpoints - 1 - rep },
		func(rep int) { setEndpoints(7, scaleEndpoints-1-rep) }))
	// Not referenced: nothing should reach the agents.
	results = append(results, measure("an unreferenced Service's slice", "", func(int) int { return 0 },
		func(rep int) { setEndpoints(nServices-1-rep, scaleEndpoints-1) }))
	window := time.Since(measureStart)
	cpu1, _ := cpuTicks(apiPID)
	etcdCPU1, _ := cpuTicks(etcdPID)

	t.Logf("cluster: %d agents, %d Services, %d endpoints, %d referenced", nAgents, nServices, nServices*scaleEndpoints, scaleReferenced)
	for _, r := range results {
		maxEv := slices.Max(r.events)
		meanEv := 0.0
		for _, e := range r.events {
			meanEv += float64(e)
		}
		meanEv /= float64(len(r.events))
		line := fmt.Sprintf("%s: watch events per agent per change: mean %.2f, max %d; RateLimit status writes per change %v",
			r.what, meanEv, maxEv, r.writes)
		if len(r.latencies) > 0 {
			line += fmt.Sprintf("; every agent right: p50 %v, p99 %v, max %v", quantile(r.latencies, 0.5), quantile(r.latencies, 0.99),
				slices.Max(r.latencies).Round(time.Millisecond))
		}
		t.Log(line)
		t.Logf("  API writes per change (by resource): %v", r.apiWrites)
		if maxEv > 3 {
			t.Errorf("%s: an agent received %d watch events for one change, want <= 3", r.what, maxEv)
		}
		for _, w := range r.writes {
			if w > 1 {
				t.Errorf("%s: %d RateLimit status writes for one change, want <= 1", r.what, w)
			}
		}
		if r.what == "an unreferenced Service's slice" && maxEv != 0 {
			t.Errorf("%s: an agent received %d events, want 0", r.what, maxEv)
		}
		if len(r.latencies) > 0 && nAgents >= 300 && quantile(r.latencies, 0.99) > time.Second {
			t.Errorf("%s: p99 %v until every agent's count was right, want <= 1 s", r.what, quantile(r.latencies, 0.99))
		}
	}
	apiRSS, etcdRSS, realRSS := rssMiB(t, apiPID), rssMiB(t, etcdPID), rssMiB(t, realPID)
	t.Logf("kube-apiserver: %.1f%% of a core over the %v of changes, RSS %.0f MiB (%.0f MiB before the agents: %.2f MiB per agent); etcd: %.1f%%, RSS %.0f MiB",
		100*ticksSeconds(cpu1-cpu0)/window.Seconds(), window.Round(time.Second), apiRSS, apiRSS0, (apiRSS-apiRSS0)/float64(nAgents),
		100*ticksSeconds(etcdCPU1-etcdCPU0)/window.Seconds(), etcdRSS)
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	heap := float64(ms.HeapInuse) / (1 << 20)
	t.Logf("the test process (the %d simulated agents): heap %.0f MiB in use, %.2f MiB per agent", nAgents, heap, heap/float64(nAgents))
	t.Logf("a real rlagent in this cluster: RSS %.1f MiB", realRSS)
	if realRSS > 64 {
		t.Errorf("a real rlagent's RSS is %.1f MiB, want <= 64 MiB", realRSS)
	}
}

// scaleSlice is Service name's EndpointSlice with n ready endpoints, as
// the EndpointSlice controller writes it.
func scaleSlice(name string, i, n int, node func(int) string) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
			discoveryv1.LabelServiceName: name, discoveryv1.LabelManagedBy: sliceController,
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr("udp"), Port: ptr[int32](5353), Protocol: ptr(corev1.ProtocolUDP)}},
	}
	for j := range n {
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{fmt.Sprintf("10.%d.%d.%d", 64+(i*scaleEndpoints+j)/65536, ((i*scaleEndpoints+j)/256)%256, (i*scaleEndpoints+j)%256)},
			NodeName:   ptr(node(i*scaleEndpoints + j)),
			Conditions: discoveryv1.EndpointConditions{Ready: ptr(true)},
		})
	}
	return s
}

// parallel runs f(0..n-1) on workers goroutines, failing t on the first error.
func parallel(t *testing.T, n, workers int, f func(i int) error) {
	t.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	var first atomic.Pointer[error]
	for range workers {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n || first.Load() != nil {
					return
				}
				if err := f(i); err != nil {
					first.CompareAndSwap(nil, &err)
					return
				}
			}
		})
	}
	wg.Wait()
	if e := first.Load(); e != nil {
		t.Fatal(*e)
	}
}

// apiWrites reads the API server's count of mutating requests so far, by
// resource (subresource after a slash).
func apiWrites(t *testing.T, env *k8stest.Env) map[string]float64 {
	t.Helper()
	body, err := env.Clientset().Discovery().RESTClient().Get().AbsPath("/metrics").DoRaw(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]float64)
	sc := bufio.NewScanner(strings.NewReader(string(body)))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "apiserver_request_total{") {
			continue
		}
		labels := line[strings.IndexByte(line, '{')+1 : strings.LastIndexByte(line, '}')]
		l := parseLabels(labels)
		switch l["verb"] {
		case "POST", "PUT", "PATCH", "DELETE", "APPLY":
		default:
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(line[strings.LastIndexByte(line, '}')+1:]), 64)
		if err != nil {
			continue
		}
		key := l["resource"]
		if l["subresource"] != "" {
			key += "/" + l["subresource"]
		}
		out[key] += v
	}
	return out
}

func parseLabels(s string) map[string]string {
	out := make(map[string]string)
	for s != "" {
		eq := strings.IndexByte(s, '=')
		if eq < 0 || eq+1 >= len(s) || s[eq+1] != '"' {
			break
		}
		name := s[:eq]
		end := strings.IndexByte(s[eq+2:], '"')
		if end < 0 {
			break
		}
		out[name] = s[eq+2 : eq+2+end]
		s = strings.TrimPrefix(s[eq+2+end+1:], ",")
	}
	return out
}

func subMetrics(a, b map[string]float64) map[string]float64 {
	out := make(map[string]float64)
	for k, v := range a {
		if d := v - b[k]; d != 0 {
			out[k] = d
		}
	}
	return out
}

func ticksSeconds(t uint64) float64 { return float64(t) / 100 }

// rssMiB is a process's resident memory (VmRSS) in MiB.
func rssMiB(t *testing.T, pid int) float64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			return kb / 1024
		}
	}
	t.Fatalf("/proc/%d/status: no VmRSS", pid)
	return 0
}
