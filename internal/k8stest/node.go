package k8stest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rlagent/rlagent/internal/nettest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// A node: a single-node cluster of real components only, in namespaces of
// its own so that nothing of it touches the machine it runs on.
//
// Every process of the cluster (etcd, kube-apiserver, kube-controller-
// manager, kube-scheduler, containerd, the kubelet, kube-proxy) runs in one
// network namespace (the node's, with a veth "uplink" to a client
// namespace) and one mount namespace with private propagation (a holder
// process keeps it; the others enter it with nsenter). So kube-proxy's
// iptables rules live in the node's network namespace, the kubelet's and
// containerd's mounts (overlay root filesystems, volumes, its bind mount of
// its root directory) in the node's mount namespace, and the pins of a
// hostPath /sys/fs/bpf/... in a bpffs mounted there: all of it goes with
// the namespaces. What is global and changed is put back on teardown: the
// sysctls the kubelet writes, and the cgroups it creates (below a cgroup
// root of the node's own, so that a kubelet of the machine's keeps its
// pods).
//
// Images come from files (there is no registry): the pause image is a
// small program of this package's, and the tests import theirs with
// ImportImage.

// NodeDeps are the Debian packages a node needs (make deps-node).
const NodeDeps = "containerd runc containernetworking-plugins iptables conntrack"

// Node is a running single-node cluster.
type Node struct {
	*Env
	// NS is the node's network namespace; Client the client namespace at
	// the other end of the node's "uplink" veth.
	NS, Client *nettest.NS
	Pair       *nettest.Pair
	// Addr is the node's address on the uplink (the API server's too).
	Addr netip.Addr
	// Name is the node's name in the cluster.
	Name string

	tb      testing.TB
	dir     string
	holder  *process
	wrap    []string // nsenter into the node's namespaces
	bins    map[string]string
	sock    string // containerd's
	procs   []*process
	logs    []string
	sysctls map[string]string // saved by saveSysctls
	// madeShimRoot: the host had no /run/containerd before the node.
	madeShimRoot bool
	// cgroupRoot is the kubelet's cgroupRoot, below every hierarchy's root.
	cgroupRoot string
}

// shimRoot is where containerd 1.6's shims make their sockets.
const shimRoot = "/run/containerd"

// NodeName is the node's name in the cluster.
const NodeName = "rlagent-node"

// sysctls the kubelet sets globally (kernel defaults it wants), put back on
// teardown.
var kubeletSysctls = []string{"vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops"}

// StartNode starts a single-node cluster for tb and tears it down when tb
// ends. It skips tb (fails it with RLAGENT_REQUIRE_ROOT_TESTS=1) when a
// component is missing: the Debian packages of NodeDeps, or the Kubernetes
// binaries, which it builds on first use.
func StartNode(tb testing.TB) *Node {
	tb.Helper()
	testenv.RequireRoot(tb)
	for _, cmd := range []string{"containerd", "ctr", "runc", "iptables", "nsenter", "unshare", "mount"} {
		if _, err := exec.LookPath(cmd); err != nil {
			testenv.SkipOrFail(tb, "a node needs %s (Debian packages: %s; make deps-node installs them)", cmd, NodeDeps)
			return nil
		}
	}
	if _, err := os.Stat("/usr/lib/cni/bridge"); err != nil {
		testenv.SkipOrFail(tb, "a node needs the CNI plugins in /usr/lib/cni (package containernetworking-plugins; make deps-node)")
		return nil
	}
	apiserver, etcd, err := ensureBinaries(tb)
	if err != nil {
		testenv.SkipOrFail(tb, "no kube-apiserver and etcd: %v", err)
		return nil
	}
	bins, err := EnsureNodeBinaries(context.Background(), tb.Logf)
	if err != nil {
		testenv.SkipOrFail(tb, "no node binaries: %v", err)
		return nil
	}

	n := &Node{tb: tb, dir: tb.TempDir(), bins: bins, Name: NodeName}
	began := time.Now()
	n.Pair = nettest.MustPair(tb, nettest.PairConfig{
		NameA: "node-client", NameB: "node", IfA: "client", IfB: "uplink",
		Subnet4: netip.MustParsePrefix("10.251.0.0/24"),
		Subnet6: netip.MustParsePrefix("fd00:251::/64"),
	})
	n.NS, n.Client, n.Addr = n.Pair.B, n.Pair.A, n.Pair.B4
	// A node has a route for its Services' ClusterIPs (a default route,
	// usually): kube-proxy translates them after routing.
	n.run0("ip", "route", "add", ServiceClusterIPRange, "dev", "uplink")

	// The holder: in the node's network namespace, a mount namespace of
	// its own with private propagation, and a bpffs of its own on
	// /sys/fs/bpf, so that the pins of the agent's hostPath never reach the
	// host's.
	holder := exec.Command("unshare", "--mount", "--propagation", "private", "--", "sleep", "infinity")
	if err := n.NS.Start(holder); err != nil {
		tb.Fatalf("start the node's mount namespace: %v", err)
	}
	n.holder = &process{name: "holder", cmd: holder, done: make(chan struct{})}
	go func() { n.holder.waitErr = holder.Wait(); close(n.holder.done) }()
	tb.Cleanup(n.teardown)
	pid := strconv.Itoa(holder.Process.Pid)
	n.wrap = []string{"nsenter", "--target", pid, "--mount", "--net", "--"}
	n.waitMountNS()
	n.run("mount", "-t", "bpf", "bpffs", "/sys/fs/bpf")
	// containerd's shims put their sockets under /run/containerd whatever
	// the config says: a tmpfs of the node's there. (The mount point is
	// made on the host if missing, and removed again.)
	if _, err := os.Stat(shimRoot); errors.Is(err, os.ErrNotExist) {
		if err := os.Mkdir(shimRoot, 0o711); err != nil {
			tb.Fatal(err)
		}
		n.madeShimRoot = true
	}
	n.run("mount", "-t", "tmpfs", "-o", "mode=0711", "tmpfs", shimRoot)
	n.saveSysctls()

	// The control plane.
	dial := func(ctx context.Context, network, addr string) (c net.Conn, err error) {
		err = n.NS.Do(func() error {
			c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
			return err
		})
		return c, err
	}
	cp := filepath.Join(n.dir, "control-plane")
	if err := os.MkdirAll(cp, 0o755); err != nil {
		tb.Fatal(err)
	}
	env, err := start(apiserver, etcd, cp, tb.Logf,
		serverOptions{wrap: n.wrap, addr: n.Addr.String(), dial: dial})
	if err != nil {
		tb.Fatalf("start etcd and kube-apiserver in the node: %v", err)
	}
	n.Env = env
	ca := filepath.Join(env.Dir, "apiserver-certs", "apiserver.crt")
	n.start("kube-controller-manager", bins["kube-controller-manager"],
		"--kubeconfig="+env.Kubeconfig,
		"--leader-elect=false",
		"--controllers=*",
		"--service-account-private-key-file="+env.saKey,
		"--root-ca-file="+ca,
		"--use-service-account-credentials=false",
		"--cluster-cidr=10.252.0.0/16",
		"--allocate-node-cidrs=false",
		"--bind-address=127.0.0.1",
	)
	n.start("kube-scheduler", bins["kube-scheduler"], "--kubeconfig="+env.Kubeconfig, "--leader-elect=false", "--bind-address=127.0.0.1")

	// The runtime.
	n.startContainerd()
	n.importPause()

	// The kubelet, then kube-proxy.
	n.cgroupRoot = fmt.Sprintf("rlagent-k8stest-%d", os.Getpid())
	n.makeCgroupRoot()
	n.startKubelet()
	n.waitNodeReady(90 * time.Second)
	n.startKubeProxy()
	n.waitServiceRoute(60 * time.Second)
	tb.Logf("k8stest: node %s ready in %v (kubelet, containerd, kube-proxy, controller-manager, scheduler, API server at %s)",
		n.Name, time.Since(began).Round(time.Millisecond), env.url)
	return n
}

// run0 runs a command in the node's network namespace only (before the
// holder exists) and fails tb if it fails.
func (n *Node) run0(name string, args ...string) {
	n.tb.Helper()
	cmd := exec.Command(name, args...)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := n.NS.Start(cmd); err != nil {
		n.tb.Fatalf("%s: %v", name, err)
	}
	if err := cmd.Wait(); err != nil {
		n.tb.Fatalf("%s %s in the node: %v\n%s", name, strings.Join(args, " "), err, out.String())
	}
}

// run runs a command in the node's namespaces and fails tb if it fails.
func (n *Node) run(name string, args ...string) string {
	n.tb.Helper()
	out, err := n.Output(name, args...)
	if err != nil {
		n.tb.Fatalf("%s %s in the node: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

// Output runs a command in the node's namespaces (its network and mount
// namespace) and returns its combined output.
func (n *Node) Output(name string, args ...string) (string, error) {
	cmd := exec.Command(n.wrap[0], append(append(slices.Clone(n.wrap[1:]), name), args...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// Kubectl runs kubectl against the cluster, in the node, and returns its
// output; a failure fails tb.
func (n *Node) Kubectl(args ...string) string {
	n.tb.Helper()
	out, err := n.KubectlErr(args...)
	if err != nil {
		n.tb.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// KubectlErr is Kubectl that returns the error.
func (n *Node) KubectlErr(args ...string) (string, error) {
	return n.Output(n.bins["kubectl"], append([]string{"--kubeconfig", n.Env.Kubeconfig}, args...)...)
}

// ImportImage imports an image tarball (docker or OCI archive) into the
// node's containerd, for pods with imagePullPolicy Never.
func (n *Node) ImportImage(path string) {
	n.tb.Helper()
	n.run("ctr", "--address", n.sock, "-n", "k8s.io", "images", "import", "--no-unpack=false", path)
}

// start starts a component in the node's namespaces; teardown stops it.
func (n *Node) start(name, path string, args ...string) *process {
	n.tb.Helper()
	logPath := filepath.Join(n.dir, name+".log")
	p, err := startProcess(name, logPath, n.wrap[0], append(append(slices.Clone(n.wrap[1:]), path), args...)...)
	if err != nil {
		n.tb.Fatalf("start %s: %v", name, err)
	}
	n.procs = append(n.procs, p)
	n.logs = append(n.logs, logPath)
	return p
}

// waitMountNS waits until the holder is in a mount namespace of its own.
func (n *Node) waitMountNS() {
	n.tb.Helper()
	self, _ := os.Readlink("/proc/self/ns/mnt")
	deadline := time.Now().Add(10 * time.Second)
	for {
		ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", n.holder.cmd.Process.Pid))
		cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", n.holder.cmd.Process.Pid))
		if err == nil && ns != self && strings.HasPrefix(string(cmdline), "sleep") {
			return
		}
		if done, err := n.holder.exited(); done {
			n.tb.Fatalf("the node's holder exited: %v", err)
		}
		if time.Now().After(deadline) {
			n.tb.Fatalf("the node's holder has no mount namespace of its own after 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (n *Node) startContainerd() {
	n.tb.Helper()
	root, state := filepath.Join(n.dir, "containerd"), filepath.Join(n.dir, "containerd-state")
	cni := filepath.Join(n.dir, "cni")
	n.sock = filepath.Join(state, "containerd.sock")
	for _, d := range []string{root, state, cni} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			n.tb.Fatal(err)
		}
	}
	// A bridge and loopback: the node is Ready only with a CNI config
	// (hostNetwork pods never call it).
	conflist := `{"cniVersion": "0.4.0", "name": "k8stest", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.252.0.0/24"}]]}},
  {"type": "loopback"}]}`
	if err := os.WriteFile(filepath.Join(cni, "10-k8stest.conflist"), []byte(conflist), 0o644); err != nil {
		n.tb.Fatal(err)
	}
	// restrict_oom_score_adj: root here lacks CAP_SYS_RESOURCE in its
	// bounding set, and runc fails every sandbox that would lower an
	// oom_score_adj ("can't get final child's PID from pipe: EOF").
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = %q
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
[plugins."io.containerd.internal.v1.opt"]
  path = %q
`, root, state, n.sock, PauseImage, filepath.Join(state, "runc"), cni, filepath.Join(root, "opt"))
	path := filepath.Join(n.dir, "containerd.toml")
	if err := os.WriteFile(path, []byte(config), 0o644); err != nil {
		n.tb.Fatal(err)
	}
	p := n.start("containerd", "containerd", "--config", path)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := n.Output("ctr", "--address", n.sock, "version"); err == nil {
			return
		}
		if done, err := p.exited(); done {
			n.tb.Fatalf("containerd exited: %v\n%s", err, tail(p.logPath, 30))
		}
		if time.Now().After(deadline) {
			n.tb.Fatalf("containerd did not answer within 30 s\n%s", tail(p.logPath, 30))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// PauseImage is the sandbox image: this package's pause program. A
// test may run it as a pod's container too (a pod that does nothing).
const PauseImage = "registry.k8s.io/pause:k8stest"

func (n *Node) importPause() {
	n.tb.Helper()
	bin := filepath.Join(n.dir, "pause")
	build := exec.Command("go", "build", "-trimpath", "-o", bin, "github.com/rlagent/rlagent/internal/k8stest/pause")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		n.tb.Fatalf("build the pause program: %v\n%s", err, out)
	}
	tar := BuildImage(n.tb, bin, "pause", strings.Split(PauseImage, ":")[0], strings.Split(PauseImage, ":")[1], filepath.Join(n.dir, "pause-image"))
	n.ImportImage(tar)
}

// BuildImage makes an image of one static binary with make image's tool
// (hack/tools/image): the binary at path in the image, its entrypoint,
// tagged repo:version. It returns the tarball's path.
func BuildImage(tb testing.TB, binary, path, repo, version, out string) string {
	tb.Helper()
	root, err := moduleRoot()
	if err != nil {
		tb.Fatal(err)
	}
	cmd := exec.Command("go", "-C", filepath.Join(root, "hack/tools/image"), "run", ".", "build",
		"--binary", binary, "--path", path, "--repo", repo, "--version", version, "--out", out)
	if b, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("build the image %s:%s: %v\n%s", repo, version, err, b)
	}
	return filepath.Join(out, "rlagent.tar")
}

// moduleRoot is the rlagent module's directory.
func moduleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", err
	}
	return filepath.Dir(strings.TrimSpace(string(out))), nil
}

func (n *Node) startKubelet() {
	n.tb.Helper()
	root := filepath.Join(n.dir, "kubelet")
	if err := os.MkdirAll(root, 0o755); err != nil {
		n.tb.Fatal(err)
	}
	// cgroup v1 needs failCgroupV1 false (1.34's default, said anyway);
	// the cgroup driver is cgroupfs (no systemd here). No swap, no
	// DNS. The API server reaches the kubelet's port for exec and logs
	// without a client certificate: anonymous access, allowed (the node is
	// the test's alone).
	config := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupRoot: /%s
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://%s
address: %s
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
podLogsDir: %s
resolvConf: ""
staticPodPath: ""
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%%"
  imagefs.available: "1%%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
`, n.cgroupRoot, n.sock, n.Addr, filepath.Join(n.dir, "pod-logs"))
	path := filepath.Join(n.dir, "kubelet.yaml")
	if err := os.WriteFile(path, []byte(config), 0o644); err != nil {
		n.tb.Fatal(err)
	}
	n.start("kubelet", n.bins["kubelet"],
		"--config="+path,
		"--kubeconfig="+n.Env.Kubeconfig,
		"--root-dir="+root,
		"--hostname-override="+n.Name,
		"--node-ip="+n.Addr.String(),
		"--v=1",
	)
}

func (n *Node) waitNodeReady(timeout time.Duration) {
	n.tb.Helper()
	deadline := time.Now().Add(timeout)
	for {
		node, err := n.Clientset().CoreV1().Nodes().Get(context.Background(), n.Name, metav1.GetOptions{})
		if err == nil {
			for _, c := range node.Status.Conditions {
				if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
					return
				}
			}
		}
		if time.Now().After(deadline) {
			n.tb.Fatalf("node %s not Ready after %v (%v)\n%s", n.Name, timeout, err, n.tails(20))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (n *Node) startKubeProxy() {
	n.tb.Helper()
	// iptables mode, in the node's network namespace. The conntrack
	// settings are the global ones kube-proxy would otherwise write
	// (nf_conntrack_max and the TCP timeouts): 0 leaves them alone.
	config := fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection:
  kubeconfig: %s
hostnameOverride: %s
bindAddress: %s
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
`, n.Env.Kubeconfig, n.Name, n.Addr)
	path := filepath.Join(n.dir, "kube-proxy.yaml")
	if err := os.WriteFile(path, []byte(config), 0o644); err != nil {
		n.tb.Fatal(err)
	}
	n.start("kube-proxy", n.bins["kube-proxy"], "--config="+path)
}

// waitServiceRoute waits until the kubernetes Service's ClusterIP leads to
// the API server from the node (kube-proxy's rules are in).
func (n *Node) waitServiceRoute(timeout time.Duration) {
	n.tb.Helper()
	deadline := time.Now().Add(timeout)
	for {
		var err error
		nsErr := n.NS.Do(func() error {
			var c net.Conn
			c, err = net.DialTimeout("tcp", "10.96.0.1:443", time.Second)
			if err == nil {
				c.Close()
			}
			return nil
		})
		if nsErr == nil && err == nil {
			return
		}
		if time.Now().After(deadline) {
			n.tb.Fatalf("the kubernetes Service (10.96.0.1:443) does not lead to the API server after %v: %v\n%s", timeout, err, n.tails(20))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// tails is the end of every component's log.
func (n *Node) tails(lines int) string {
	var b strings.Builder
	for _, p := range n.logs {
		fmt.Fprintf(&b, "--- %s ---\n%s\n", filepath.Base(p), tail(p, lines))
	}
	return b.String()
}

// saveSysctls records the global sysctls the kubelet changes, and puts
// them back on teardown.
func (n *Node) saveSysctls() {
	saved := make(map[string]string)
	for _, s := range kubeletSysctls {
		if b, err := os.ReadFile("/proc/sys/" + s); err == nil {
			saved[s] = strings.TrimSpace(string(b))
		}
	}
	n.sysctls = saved
}

// restoreSysctls puts back what saveSysctls recorded.
func (n *Node) restoreSysctls() {
	for s, v := range n.sysctls {
		if b, _ := os.ReadFile("/proc/sys/" + s); strings.TrimSpace(string(b)) == v {
			continue
		}
		if err := os.WriteFile("/proc/sys/"+s, []byte(v), 0o644); err != nil {
			n.tb.Errorf("k8stest: restore sysctl %s=%s: %v", s, v, err)
		}
	}
}

// teardown stops everything the node started, in order: the pods'
// processes, the components (the control plane last), containerd's shims,
// the holder; then it removes the node's cgroups.
func (n *Node) teardown() {
	if n.tb.Failed() {
		n.tb.Logf("k8stest: the node's logs, for the failure above:\n%s", n.tails(40))
	}
	mnt, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", n.holder.cmd.Process.Pid))
	// The pods' processes: every process in the kubelet's cgroups.
	n.killCgroupProcs()
	for i := len(n.procs) - 1; i >= 0; i-- {
		if _, err := n.procs[i].stop(stopGrace); err != nil {
			n.tb.Errorf("k8stest: %v", err)
		}
	}
	if n.Env != nil {
		if err := n.Env.stop(); err != nil {
			n.tb.Errorf("k8stest: %v", err)
		}
	}
	// containerd's shims left the process tree: they are the processes
	// in the node's mount namespace.
	if mnt != "" {
		killInMountNS(mnt, n.holder.cmd.Process.Pid)
	}
	n.holder.cmd.Process.Kill()
	<-n.holder.done
	if mnt != "" {
		deadline := time.Now().Add(10 * time.Second)
		for len(pidsInMountNS(mnt)) > 0 && time.Now().Before(deadline) {
			killInMountNS(mnt, 0)
			time.Sleep(50 * time.Millisecond)
		}
		if left := pidsInMountNS(mnt); len(left) > 0 {
			n.tb.Errorf("k8stest: processes %v are still in the node's mount namespace", left)
		}
	}
	n.killCgroupProcs()
	if err := n.removeKubeCgroups(); err != nil {
		n.tb.Errorf("k8stest: remove the kubelet's cgroups: %v", err)
	}
	n.restoreSysctls()
	if n.madeShimRoot {
		if err := os.Remove(shimRoot); err != nil {
			n.tb.Errorf("k8stest: remove %s: %v", shimRoot, err)
		}
	}
}

// cgroupHierarchies are the mounted cgroup hierarchies (v1 controllers,
// the named systemd one, the unified one), each once: a symlink such as
// cpu -> cpu,cpuacct is skipped.
func cgroupHierarchies() []string {
	entries, _ := os.ReadDir("/sys/fs/cgroup")
	var out []string
	for _, e := range entries {
		p := filepath.Join("/sys/fs/cgroup", e.Name())
		if fi, err := os.Lstat(p); err != nil || !fi.IsDir() {
			continue
		}
		if _, err := os.Stat(filepath.Join(p, "cgroup.procs")); err == nil {
			out = append(out, p)
		}
	}
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.procs"); err == nil {
		out = append(out, "/sys/fs/cgroup") // cgroup v2 only
	}
	return out
}

// makeCgroupRoot creates the kubelet's cgroupRoot in every hierarchy, so
// that its pods' cgroups are the node's alone (a kubelet of the machine's
// own keeps its kubepods): cpuset's gets its parent's CPUs and memory nodes,
// without which no process can join it.
func (n *Node) makeCgroupRoot() {
	n.tb.Helper()
	for _, h := range cgroupHierarchies() {
		dir := filepath.Join(h, n.cgroupRoot)
		if err := os.Mkdir(dir, 0o755); err != nil {
			n.tb.Fatalf("create the node's cgroup root: %v", err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if b, err := os.ReadFile(filepath.Join(h, f)); err == nil {
				if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
					n.tb.Fatalf("%s of the node's cgroup root: %v", f, err)
				}
			}
		}
	}
}

// kubeCgroupRoots are the node's cgroup root in every hierarchy: the
// kubelet creates its pods' cgroups below it, and nothing else is there.
func (n *Node) kubeCgroupRoots() []string {
	if n.cgroupRoot == "" {
		return nil // not made yet: nothing of the node's (and never a hierarchy's root)
	}
	var roots []string
	for _, h := range cgroupHierarchies() {
		if dir := filepath.Join(h, n.cgroupRoot); dirExists(dir) {
			roots = append(roots, dir)
		}
	}
	return roots
}

func dirExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.IsDir()
}

// killCgroupProcs kills every process in the node's cgroups: its pods'.
func (n *Node) killCgroupProcs() {
	for _, root := range n.kubeCgroupRoots() {
		filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.Name() != "cgroup.procs" {
				return nil
			}
			b, _ := os.ReadFile(path)
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil && pid > 1 {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			return nil
		})
	}
}

// removeKubeCgroups removes the node's cgroups, deepest first, the root
// last.
func (n *Node) removeKubeCgroups() error {
	var errs []error
	for _, root := range n.kubeCgroupRoots() {
		var dirs []string
		filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, path)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			var err error
			for range 50 { // a cgroup goes once its last process is reaped
				if err = syscall.Rmdir(dirs[i]); err == nil || errors.Is(err, os.ErrNotExist) {
					err = nil
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", dirs[i], err))
			}
		}
	}
	return errors.Join(errs...)
}

// pidsInMountNS lists the processes in the mount namespace mnt.
func pidsInMountNS(mnt string) []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ns, err := os.Readlink("/proc/" + e.Name() + "/ns/mnt"); err == nil && ns == mnt {
			pids = append(pids, pid)
		}
	}
	return pids
}

// killInMountNS kills the processes in the mount namespace mnt, but skip.
func killInMountNS(mnt string, skip int) {
	for _, pid := range pidsInMountNS(mnt) {
		if pid != skip {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}
