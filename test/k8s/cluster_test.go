package k8s

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/agenttest"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/nettest"
)

// The Service the service-scoped limits name: UDP svcPort on every endpoint.
const (
	svcName     = "web"
	svcPortName = "dns"
	svcPort     = 5353
)

// agentDaemonSet is the agents' DaemonSet in a test's namespace: its
// status.numberReady is the count of scope nodes. The test creates it and
// writes its status: there is no controller-manager or kubelet.
const agentDaemonSet = "rlagent"

// maxLocal is how many endpoint addresses each node's B side holds.
const maxLocal = 4

// fieldManager names the tests' server-side applies.
const fieldManager = "rlagent-k8s-test"

// sliceController is the managed-by label of the EndpointSlice
// controller's slices: the tests write slices as it would, and the agents
// count no others.
const sliceController = "endpointslice-controller.k8s.io"

// deployDir is the repository's deploy/ directory.
const deployDir = "../../deploy"

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// dynamicClient is a dynamic client for env.
func dynamicClient(t testing.TB, env *k8stest.Env) *dynamic.DynamicClient {
	t.Helper()
	d, err := dynamic.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// installCRD creates or updates the RateLimit CRD from deploy/crd.yaml
// (server-side apply) and waits until it is Established and RateLimits can
// be listed. It is idempotent: every test calls it on the shared server.
//
// In the first seconds after the CRD is created, a new RateLimit reaches the
// agents about 2 s late (the API server is still setting up the new
// resource's watch); so the tests wait up to 10 s for a new limit, and time
// count changes, not creations.
func installCRD(t testing.TB, env *k8stest.Env) {
	t.Helper()
	docs := readManifests(t, filepath.Join(deployDir, "crd.yaml"))
	if len(docs) != 1 || docs[0].GetKind() != "CustomResourceDefinition" {
		t.Fatalf("deploy/crd.yaml: want one CustomResourceDefinition, got %d documents", len(docs))
	}
	crd := docs[0]
	d := dynamicClient(t, env)
	ctx := t.Context()
	if _, err := d.Resource(crdGVR).Apply(ctx, crd.GetName(), crd, metav1.ApplyOptions{FieldManager: fieldManager, Force: true}); err != nil {
		t.Fatalf("apply deploy/crd.yaml: %v", err)
	}
	waitFor(t, 30*time.Second, "the RateLimit CRD to be Established and served", func() (bool, string) {
		cur, err := d.Resource(crdGVR).Get(ctx, crd.GetName(), metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		if c := condition(cur, "Established"); c["status"] != "True" {
			return false, fmt.Sprintf("Established: %v", c)
		}
		if _, err := d.Resource(v1alpha1.RateLimitResource).List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
			return false, err.Error()
		}
		return true, ""
	})
}

// condition returns the status condition of type typ of obj, or nil.
func condition(obj *unstructured.Unstructured, typ string) map[string]any {
	conds, _, _ := unstructured.NestedSlice(obj.Object, "status", "conditions")
	for _, c := range conds {
		if m, ok := c.(map[string]any); ok && m["type"] == typ {
			return m
		}
	}
	return nil
}

// waitFor polls cond every 20 ms until it holds, and fails t if it does not
// within timeout, with cond's last explanation.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() (bool, string)) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		ok, why := cond()
		if ok {
			return time.Since(start)
		}
		if time.Since(start) > timeout {
			t.Fatalf("waited %v for %s: %s", timeout, what, why)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitAccepted waits up to timeout until RateLimit name's Accepted
// condition has status and reason and its message says each of msg.
func waitAccepted(t testing.TB, rl dynamic.NamespaceableResourceInterface, timeout time.Duration, name, status,
	reason string, msg ...string) {
	t.Helper()
	took := waitFor(t, timeout, fmt.Sprintf("RateLimit %s: Accepted=%s, reason %s", name, status, reason), func() (bool, string) {
		obj, err := rl.Get(t.Context(), name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		c := condition(obj, v1alpha1.ConditionAccepted)
		if c == nil || c["status"] != status || c["reason"] != reason {
			return false, fmt.Sprintf("status %v", obj.Object["status"])
		}
		for _, m := range msg {
			if !strings.Contains(fmt.Sprint(c["message"]), m) {
				return false, fmt.Sprintf("message %q does not say %q", c["message"], m)
			}
		}
		t.Logf("%s: Accepted=%s (reason %s, message %q)", name, status, reason, c["message"])
		return true, ""
	})
	t.Logf("%s: condition seen %s after the wait began", name, ms(took))
}

// readManifests reads the YAML documents of a manifest file, skipping
// empty ones (only comments).
func readManifests(t testing.TB, path string) []*unstructured.Unstructured {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []*unstructured.Unstructured
	for i, doc := range splitYAML(string(data)) {
		js, err := yaml.YAMLToJSON([]byte(doc))
		if err != nil {
			t.Fatalf("%s: document %d: %v", path, i+1, err)
		}
		if s := strings.TrimSpace(string(js)); s == "null" || s == "{}" {
			continue
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(js); err != nil {
			t.Fatalf("%s: document %d: %v", path, i+1, err)
		}
		out = append(out, u)
	}
	return out
}

// splitYAML splits a multi-document YAML stream at its "---" lines.
func splitYAML(s string) []string {
	var docs []string
	var cur strings.Builder
	for line := range strings.SplitSeq(s, "\n") {
		if strings.TrimRight(line, " \t\r") == "---" {
			docs = append(docs, cur.String())
			cur.Reset()
			continue
		}
		cur.WriteString(line)
		cur.WriteByte('\n')
	}
	return append(docs, cur.String())
}

// node is one simulated Kubernetes node: the agent in B, with its own
// NODE_NAME, config file and pin directory; the clients in A.
type node struct {
	index int // 1-based
	name  string
	pair  *nettest.Pair
	pins  *agenttest.Pins
	agent *agenttest.Agent
	api   *forwarder // the API server, on B's loopback
	// recv counts what arrives at B's UDP svcPort, on every address.
	recv *nettest.Receiver
	// config is the agent's config file, yml what it holds, and args
	// the agent's command line (restart).
	config, yml string
	args        []string
}

// restart stops the node's agent (SIGTERM: the data path stays attached
// with the last shares) and starts another with extra lines in its config
// file, as an upgrade does; it waits until the new agent attached.
func (nd *node) restart(t testing.TB, extra string) {
	t.Helper()
	start := time.Now()
	nd.agent.Stop(syscall.SIGTERM, 20*time.Second)
	stopped := time.Now()
	if err := os.WriteFile(nd.config, []byte(nd.yml+extra), 0o644); err != nil {
		t.Fatal(err)
	}
	nd.agent = agenttest.StartAgent(t, nd.pair.B, rlagentBin, nd.args...)
	nd.agent.WaitAttached(agenttest.AttachTimeout)
	t.Logf("%s's agent: stopped in %v, the new one attached %v later", nd.name, ms(stopped.Sub(start)), ms(time.Since(stopped)))
}

// endpointAddr is the address of endpoint j (1..maxLocal) of node i: it is
// on node i's B side, and A routes to it.
func endpointAddr(i, j int) netip.Addr { return netip.AddrFrom4([4]byte{10, 244, byte(i), byte(j)}) }

// notReadyAddr is the address of a not-ready endpoint on node i.
func notReadyAddr(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 244, byte(i), 200}) }

// cluster is a test's simulated nodes, each with a running agent, against
// one API server. ns is the test's namespace: its Service, its
// EndpointSlices and the agents' pods live there.
type cluster struct {
	t     testing.TB
	env   *k8stest.Env
	ns    string
	nodes []*node
	// slices are the EndpointSlices as last written, by name.
	slices map[string]*discoveryv1.EndpointSlice
}

// startCluster starts n nodes, each with an agent of the binary under test,
// and waits until every agent has attached. Cleanup stops them all.
func startCluster(t testing.TB, env *k8stest.Env, ns string, n int) *cluster {
	t.Helper()
	return startClusterWith(t, env, ns, n, "")
}

// startClusterWith is startCluster with more lines in every agent's config
// file.
func startClusterWith(t testing.TB, env *k8stest.Env, ns string, n int, extra string) *cluster {
	t.Helper()
	c := &cluster{t: t, env: env, ns: ns, slices: make(map[string]*discoveryv1.EndpointSlice)}
	apiAddr := apiServerAddr(t, env)
	dir := t.TempDir()
	for i := 1; i <= n; i++ {
		nd := &node{index: i, name: fmt.Sprintf("node-%d", i)}
		nd.pair = nettest.MustPair(t, nettest.PairConfig{
			NameA: nd.name + "-client", NameB: nd.name, IfA: "veth-client", IfB: "veth-node",
			Subnet4: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 202, byte(i), 0}), 24),
			Subnet6: netip.MustParsePrefix(fmt.Sprintf("fd00:202:%d::/64", i)),
		})
		nd.addEndpointAddresses(t)
		nodeDir := filepath.Join(dir, nd.name)
		if err := os.Mkdir(nodeDir, 0o755); err != nil {
			t.Fatal(err)
		}
		nd.pins = agenttest.PinDir(t, rlagentBin, filepath.Join(nodeDir, "bpf"))
		config := filepath.Join(nodeDir, "rlagent.yaml")
		yml := fmt.Sprintf("interfaces: [%s]\npinDir: %s\nmetricsAddress: \"off\"\n%s", nd.pair.IfB, nd.pins.Dir, extra)
		if err := os.WriteFile(config, []byte(yml), 0o644); err != nil {
			t.Fatal(err)
		}
		nd.api = forwardTCP(t, nd.pair.B, apiAddr)
		conn, err := nd.pair.B.ListenUDP("udp4", netip.AddrPortFrom(netip.IPv4Unspecified(), svcPort), 8<<20)
		if err != nil {
			t.Fatal(err)
		}
		nd.recv = nettest.StartReceiver(conn, nettest.ReceiverConfig{Span: 3 * time.Minute})
		t.Cleanup(func() { nd.recv.Close() })
		nd.config, nd.yml = config, yml
		nd.args = []string{
			"--config", config,
			"--kubeconfig", env.Kubeconfig,
			"--node-name", nd.name,
			"--agent-namespace", ns,
			"--agent-daemonset", agentDaemonSet,
			"--pod-name", "rlagent-" + nd.name,
			"--log-level", "debug",
		}
		nd.agent = agenttest.StartAgent(t, nd.pair.B, rlagentBin, nd.args...)
		c.nodes = append(c.nodes, nd)
	}
	for _, nd := range c.nodes {
		nd.agent.WaitAttached(agenttest.AttachTimeout)
	}
	return c
}

// setAgents writes the status of the agents' DaemonSet as its controller
// would, ready of desired pods ready (desired: the cluster's nodes),
// creating it first if needed.
func (c *cluster) setAgents(ready int) {
	c.t.Helper()
	setDaemonSetReady(c.t, c.env, c.ns, agentDaemonSet, ready, max(ready, len(c.nodes)))
}

// setDaemonSetReady writes a DaemonSet's status (k8stest).
func setDaemonSetReady(t testing.TB, env *k8stest.Env, ns, name string, ready, desired int) {
	t.Helper()
	env.SetDaemonSetStatus(t, ns, name, ready, desired)
}

// addEndpointAddresses puts the node's endpoint addresses on B's veth and
// routes A to them through B.
func (nd *node) addEndpointAddresses(t testing.TB) {
	t.Helper()
	nl, err := nd.pair.B.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	l, err := nl.LinkByName(nd.pair.IfB)
	if err != nil {
		t.Fatal(err)
	}
	for j := 1; j <= maxLocal; j++ {
		a := endpointAddr(nd.index, j)
		if err := nl.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(32, 32)}}); err != nil {
			t.Fatalf("add %s to %s in %s: %v", a, nd.pair.IfB, nd.pair.B.Name, err)
		}
	}
	nlA, err := nd.pair.A.Netlink()
	if err != nil {
		t.Fatal(err)
	}
	defer nlA.Close()
	la, err := nlA.LinkByName(nd.pair.IfA)
	if err != nil {
		t.Fatal(err)
	}
	dst := netip.PrefixFrom(endpointAddr(nd.index, 0), 24)
	route := &netlink.Route{
		LinkIndex: la.Attrs().Index,
		Dst:       &net.IPNet{IP: dst.Addr().AsSlice(), Mask: net.CIDRMask(24, 32)},
		Gw:        nd.pair.B4.AsSlice(),
	}
	if err := nlA.RouteAdd(route); err != nil {
		t.Fatalf("route %s via %s in %s: %v", dst, nd.pair.B4, nd.pair.A.Name, err)
	}
}

// apiServerAddr is the host:port of env's API server.
func apiServerAddr(t testing.TB, env *k8stest.Env) string {
	t.Helper()
	u, err := url.Parse(env.Config.Host)
	if err != nil {
		t.Fatal(err)
	}
	return u.Host
}

// forwarder makes the API server, which listens on the host's loopback
// only, reachable at the same address inside a node's namespace, so that
// the agent there uses the kubeconfig as it is: it listens on addr inside
// the namespace and forwards every connection to addr in the host's.
//
// While the API server is stopped, the test closes the listener (down), so
// that the agents meet what they would on a real node: connection refused,
// and their open connections gone. (Accepting and closing connections
// instead would show them another failure, which client-go retries
// differently.)
type forwarder struct {
	t    testing.TB
	ns   *nettest.NS
	addr string
	wg   sync.WaitGroup

	mu    sync.Mutex
	ln    net.Listener // nil while down
	conns map[net.Conn]struct{}
}

// forwardTCP starts a forwarder of addr into ns. Cleanup stops it and
// waits for its goroutines.
func forwardTCP(t testing.TB, ns *nettest.NS, addr string) *forwarder {
	t.Helper()
	f := &forwarder{t: t, ns: ns, addr: addr, conns: make(map[net.Conn]struct{})}
	f.up()
	t.Cleanup(func() {
		f.down()
		f.wg.Wait()
	})
	return f
}

// up listens and forwards again.
func (f *forwarder) up() {
	f.t.Helper()
	var ln net.Listener
	err := f.ns.Do(func() error {
		var err error
		ln, err = net.Listen("tcp", f.addr)
		return err
	})
	if err != nil {
		f.t.Fatalf("listen on %s in %s: %v", f.addr, f.ns.Name, err)
	}
	f.mu.Lock()
	f.ln = ln
	f.mu.Unlock()
	f.wg.Go(func() {
		for {
			down, err := ln.Accept()
			if err != nil {
				return // closed
			}
			f.wg.Go(func() { f.forward(down) })
		}
	})
}

// down closes the listener and every forwarded connection.
func (f *forwarder) down() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ln != nil {
		f.ln.Close()
		f.ln = nil
	}
	for c := range f.conns {
		c.Close()
	}
	clear(f.conns)
}

func (f *forwarder) forward(down net.Conn) {
	defer down.Close()
	up, err := net.DialTimeout("tcp", f.addr, 2*time.Second)
	if err != nil {
		return
	}
	defer up.Close()
	f.mu.Lock()
	if f.ln == nil { // went down meanwhile
		f.mu.Unlock()
		return
	}
	f.conns[down], f.conns[up] = struct{}{}, struct{}{}
	f.mu.Unlock()
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		io.Copy(dst, src)
		if tc, ok := dst.(*net.TCPConn); ok {
			tc.CloseWrite()
		}
		done <- struct{}{}
	}
	go pipe(up, down)
	go pipe(down, up)
	<-done
	<-done
	f.mu.Lock()
	delete(f.conns, down)
	delete(f.conns, up)
	f.mu.Unlock()
}

// layout is where a Service's endpoints are: ready[i] ready endpoints on
// node i+1, and one not-ready endpoint on each node in notReady (1-based).
type layout struct {
	ready    []int
	notReady []int
}

func (l layout) total() int {
	n := 0
	for _, r := range l.ready {
		n += r
	}
	return n
}

func (l layout) String() string {
	parts := make([]string, len(l.ready))
	for i, r := range l.ready {
		parts[i] = fmt.Sprint(r)
	}
	s := strings.Join(parts, "+")
	for _, i := range l.notReady {
		s += fmt.Sprintf(" (+1 not ready on node-%d)", i)
	}
	return s
}

// createService creates the Service svcName in the test's namespace.
func (c *cluster) createService() {
	c.t.Helper()
	_, err := c.env.Clientset().CoreV1().Services(c.ns).Create(c.t.Context(), &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: svcName},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{
			{Name: svcPortName, Port: svcPort, Protocol: corev1.ProtocolUDP},
		}},
	}, metav1.CreateOptions{})
	if err != nil {
		c.t.Fatalf("create Service: %v", err)
	}
}

// setEndpoints writes the Service's EndpointSlices for l, as an
// EndpointSlice controller would: web-a holds the endpoints of nodes 1 and
// 2, web-b those of the other nodes. Only the slices that change are
// written. It returns when the first write started (the change in the API
// server) and how many slices it wrote.
func (c *cluster) setEndpoints(l layout) (started time.Time, writes int) {
	c.t.Helper()
	want := map[string]*discoveryv1.EndpointSlice{}
	for _, name := range []string{svcName + "-a", svcName + "-b"} {
		want[name] = &discoveryv1.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{
				Name: name, Namespace: c.ns,
				Labels: map[string]string{discoveryv1.LabelServiceName: svcName, discoveryv1.LabelManagedBy: sliceController},
			},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports:       []discoveryv1.EndpointPort{{Name: ptr(svcPortName), Port: ptr[int32](svcPort), Protocol: ptr(corev1.ProtocolUDP)}},
		}
	}
	sliceOf := func(node int) *discoveryv1.EndpointSlice {
		if node <= 2 {
			return want[svcName+"-a"]
		}
		return want[svcName+"-b"]
	}
	for i, n := range l.ready {
		for j := 1; j <= n; j++ {
			s := sliceOf(i + 1)
			s.Endpoints = append(s.Endpoints, endpoint(endpointAddr(i+1, j), c.nodes[i].name, true))
		}
	}
	for _, i := range l.notReady {
		s := sliceOf(i)
		s.Endpoints = append(s.Endpoints, endpoint(notReadyAddr(i), c.nodes[i-1].name, false))
	}
	client := c.env.Clientset().DiscoveryV1().EndpointSlices(c.ns)
	for _, name := range []string{svcName + "-a", svcName + "-b"} {
		s, prev := want[name], c.slices[name]
		if prev != nil && slices.EqualFunc(prev.Endpoints, s.Endpoints, sameEndpoint) {
			continue
		}
		if writes == 0 {
			started = time.Now()
		}
		var got *discoveryv1.EndpointSlice
		var err error
		if prev == nil {
			got, err = client.Create(c.t.Context(), s, metav1.CreateOptions{})
		} else {
			s.ResourceVersion = prev.ResourceVersion
			got, err = client.Update(c.t.Context(), s, metav1.UpdateOptions{})
		}
		if err != nil {
			c.t.Fatalf("write EndpointSlice %s: %v", name, err)
		}
		c.slices[name] = got
		writes++
	}
	return started, writes
}

func endpoint(addr netip.Addr, node string, ready bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{
		Addresses:  []string{addr.String()},
		NodeName:   ptr(node),
		Conditions: discoveryv1.EndpointConditions{Ready: ptr(ready)},
	}
}

func sameEndpoint(a, b discoveryv1.Endpoint) bool {
	return slices.Equal(a.Addresses, b.Addresses) && *a.NodeName == *b.NodeName && *a.Conditions.Ready == *b.Conditions.Ready
}

func ptr[T any](v T) *T { return &v }

// serviceWants is what each node's status should say of a service-scoped
// limit of rate under l: rate x local / total on the nodes with a ready
// endpoint, nothing on the others.
func (c *cluster) serviceWants(rate uint64, l layout) []want {
	out := make([]want, len(c.nodes))
	total := l.total()
	for i := range c.nodes {
		local := 0
		if i < len(l.ready) {
			local = l.ready[i]
		}
		if local == 0 {
			out[i] = want{absent: true}
			continue
		}
		out[i] = want{share: rate * uint64(local) / uint64(total), replicas: uint32(total), local: uint32(local)}
	}
	return out
}

// rateLimit is a RateLimit object with spec.
func rateLimit(name string, spec map[string]any) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": v1alpha1.SchemeGroupVersion.String(),
		"kind":       "RateLimit",
		"metadata":   map[string]any{"name": name},
		"spec":       spec,
	}}
}

// serviceSpec is the spec of a limit of the test's Service, UDP, scope
// service.
func (c *cluster) serviceSpec(rate int64) map[string]any {
	return map[string]any{
		"rate":  rate,
		"scope": "service",
		"match": map[string]any{"protocol": "udp", "service": c.ns + "/" + svcName},
	}
}

// createRateLimit creates obj and deletes it in Cleanup: RateLimits are
// cluster-scoped, and the next test's agents would see it.
func createRateLimit(t testing.TB, env *k8stest.Env, obj *unstructured.Unstructured) *unstructured.Unstructured {
	t.Helper()
	rl := dynamicClient(t, env).Resource(v1alpha1.RateLimitResource)
	created, err := rl.Create(t.Context(), obj, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create RateLimit %s: %v", obj.GetName(), err)
	}
	deleteInCleanup(t, env, obj.GetName())
	return created
}

// deleteInCleanup deletes the RateLimit name when t ends, if it exists.
func deleteInCleanup(t testing.TB, env *k8stest.Env, name string) {
	rl := dynamicClient(t, env).Resource(v1alpha1.RateLimitResource)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := rl.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete RateLimit %s: %v", name, err)
		}
	})
}

// want is what one node's status should say of a limit: nothing (the node
// enforces none), or its share and the counts it was divided by.
type want struct {
	absent   bool
	share    uint64
	replicas uint32
	local    uint32 // service scope only
}

func (w want) String() string {
	if w.absent {
		return "no limit"
	}
	return fmt.Sprintf("share %d (replicas %d, local %d)", w.share, w.replicas, w.local)
}

func (w want) matches(s agent.LimitStatus, ok bool) bool {
	if w.absent || !ok {
		return w.absent == !ok
	}
	return s.ShareRate == w.share && s.Replicas == w.replicas && s.Local == w.local
}

func describe(s agent.LimitStatus, ok bool) string {
	if !ok {
		return "no limit"
	}
	return fmt.Sprintf("share %d (replicas %d, local %d, age %.1f s, stale %v)", s.ShareRate, s.Replicas, s.Local, s.ObservationAge, s.Stale)
}

// limit reads the node's status of the named limit from its pinned maps,
// in process: agent.ReadStatus is what `rlagent status` prints, without
// the cost of starting a process, which would blur the latencies measured.
func (nd *node) limit(t testing.TB, name string) (agent.LimitStatus, bool) {
	t.Helper()
	st, err := agent.ReadStatus(nd.pins.Dir)
	if err != nil {
		t.Fatalf("%s: read status: %v", nd.name, err)
	}
	for _, s := range st {
		if s.Name == name {
			return s, true
		}
	}
	return agent.LimitStatus{}, false
}

// statusCLI is the node's status of the named limit as `rlagent status
// --pin-dir DIR --output json` prints it.
func (nd *node) statusCLI(t testing.TB, name string) (agent.LimitStatus, bool) {
	t.Helper()
	st, _ := agenttest.Status[[]agent.LimitStatus](t, rlagentBin, nd.pins.Dir)
	for _, s := range st {
		if s.Name == name {
			return s, true
		}
	}
	return agent.LimitStatus{}, false
}

// applied is when a change reached each node, measured from the change in
// the API server, two ways:
//   - written: when the agent wrote the map entry, from the timestamp of its
//     log line ("limit set" or "limit removed", written right after the
//     map update, in milliseconds, on the host's clock): the issue's
//     measure, "every agent's maps rewritten";
//   - seen: when the test, polling every node's maps as `rlagent status`
//     reads them, first saw the new share: written plus up to one polling
//     round (reading a node's maps takes milliseconds to tens of
//     milliseconds under load).
type applied struct {
	written, seen []time.Duration
}

// slowest is the latest node's written and seen latencies.
func (a applied) slowest() (written, seen time.Duration) {
	return slices.Max(a.written), slices.Max(a.seen)
}

func (a applied) String() string {
	w, s := a.slowest()
	return fmt.Sprintf("maps rewritten on every node %s after the change (per node %v; status showed it after %s)", ms(w), msList(a.written), ms(s))
}

// waitShares polls every node's status of the named limit until each
// matches its want, and returns when each node applied it (see applied).
// After timeout it returns an error that says what each node showed.
func (c *cluster) waitShares(name string, wants []want, since time.Time, timeout time.Duration) (applied, error) {
	c.t.Helper()
	a := applied{written: make([]time.Duration, len(c.nodes)), seen: make([]time.Duration, len(c.nodes))}
	done := make([]bool, len(c.nodes))
	for {
		left := 0
		for i, nd := range c.nodes {
			if done[i] {
				continue
			}
			s, ok := nd.limit(c.t, name)
			if wants[i].matches(s, ok) {
				done[i], a.seen[i] = true, time.Since(since)
				continue
			}
			left++
		}
		if left == 0 {
			break
		}
		if time.Since(since) > timeout {
			var b strings.Builder
			for i, nd := range c.nodes {
				s, ok := nd.limit(c.t, name)
				fmt.Fprintf(&b, "\n  %s: %s, want %s", nd.name, describe(s, ok), wants[i])
			}
			return a, fmt.Errorf("not there after %v:%s", timeout, b.String())
		}
		// Not faster: reading the maps takes CPU from the agents measured.
		time.Sleep(20 * time.Millisecond)
	}
	for i, nd := range c.nodes {
		// Still so: no node matched a passing state.
		if s, ok := nd.limit(c.t, name); !wants[i].matches(s, ok) {
			return a, fmt.Errorf("%s: %s, want %s (it matched %v after the change)", nd.name, describe(s, ok), wants[i], a.seen[i])
		}
		at, ok := nd.written(name, wants[i], since)
		if !ok {
			return a, fmt.Errorf("%s: no log line of the agent says it wrote %s of %s after the change", nd.name, wants[i], name)
		}
		a.written[i] = at.Sub(since)
	}
	return a, nil
}

// written returns when the node's agent logged that it wrote w for the
// named limit into its maps, at or after since (the first such line). A
// node that is to enforce nothing and logged no removal had nothing to
// remove: then since itself is returned.
func (nd *node) written(name string, w want, since time.Time) (time.Time, bool) {
	// The log's timestamps have milliseconds.
	from := since.Truncate(time.Millisecond)
	for line := range strings.SplitSeq(nd.agent.Log(), "\n") {
		if !strings.Contains(line, " limit="+name+" ") && !strings.HasSuffix(line, " limit="+name) {
			continue
		}
		var match bool
		switch {
		case strings.Contains(line, `msg="limit removed"`):
			match = w.absent
		case strings.Contains(line, `msg="limit set"`):
			match = !w.absent && strings.Contains(line, fmt.Sprintf(" replicas=%d share_rate=%d ", w.replicas, w.share))
		default:
			continue
		}
		ts, _, _ := strings.Cut(strings.TrimPrefix(line, "time="), " ")
		at, err := time.Parse(time.RFC3339Nano, ts)
		if err != nil || at.Before(from) {
			continue
		}
		if match {
			return at, true
		}
	}
	if w.absent {
		// Nothing to remove: it had none.
		return since, true
	}
	return time.Time{}, false
}

// checkSum checks that the shares of every node add up to the global rate,
// less integer rounding (at most one unit per node).
func (c *cluster) checkSum(what, name string, rate uint64) {
	c.t.Helper()
	var sum uint64
	var parts []string
	for _, nd := range c.nodes {
		if s, ok := nd.limit(c.t, name); ok {
			sum += s.ShareRate
			parts = append(parts, fmt.Sprintf("%s %d", nd.name, s.ShareRate))
		}
	}
	c.t.Logf("%s: shares %s: sum %d of global %d", what, strings.Join(parts, ", "), sum, rate)
	if sum > rate || sum+uint64(len(c.nodes)) <= rate {
		c.t.Errorf("%s: the shares add up to %d, want the global rate %d (less at most %d for rounding)", what, sum, rate, len(c.nodes)-1)
	}
}

// ms formats a duration for the logs.
func ms(d time.Duration) string { return d.Round(time.Millisecond).String() }
