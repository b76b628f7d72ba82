package v1alpha1

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// These tests read deploy/ without a cluster: every manifest decodes
// strictly (an unknown or misspelled field is an error) into its typed
// object, the RateLimit examples pass the agent's validation, the CRD agrees
// with the Go types, the DaemonSet and RBAC grant what docs/kubernetes.md
// says and nothing more, and an admission policy keeps each agent to its own
// node's demand Lease. That the API server accepts them is tested against a
// real one (server-side dry run), and what the policy admits too
// (test/k8s), not here.

const deployDir = "../../deploy"

// manifest is one YAML document of a file under deploy/.
type manifest struct {
	at   string // deploy/rbac.yaml#2
	gvk  schema.GroupVersionKind
	name string
	data []byte
}

// readManifests returns every document of every .yaml file under deploy/
// except kustomization.yaml and the Helm chart, in file order. The chart's
// templates are not manifests; deploy/*.yaml is their default rendering
// (make generate), which these tests read, and hack/helm tests the chart
// with other values.
func readManifests(t *testing.T) []manifest {
	t.Helper()
	var out []manifest
	err := filepath.WalkDir(deployDir, func(path string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() && path == filepath.Join(deployDir, "helm") {
			return filepath.SkipDir
		}
		if err != nil || d.IsDir() || filepath.Ext(path) != ".yaml" || d.Name() == "kustomization.yaml" {
			return err
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		r := utilyaml.NewYAMLReader(bufio.NewReader(f))
		rel, _ := filepath.Rel(filepath.Dir(deployDir), path)
		for i := 0; ; i++ {
			doc, err := r.Read()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return err
			}
			var head struct {
				metav1.TypeMeta   `json:",inline"`
				metav1.ObjectMeta `json:"metadata"`
			}
			if err := yaml.Unmarshal(doc, &head); err != nil {
				t.Errorf("%s#%d: %v", rel, i, err)
				continue
			}
			if head.Kind == "" && len(bytes.TrimSpace(doc)) > 0 && !onlyComments(doc) {
				t.Errorf("%s#%d: a document without kind", rel, i)
			}
			if head.Kind == "" {
				continue
			}
			out = append(out, manifest{at: rel + "#" + strconv.Itoa(i), gvk: head.GroupVersionKind(), name: head.Name, data: doc})
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(out) == 0 {
		t.Fatal("no manifests under deploy/")
	}
	return out
}

func onlyComments(doc []byte) bool {
	for _, l := range strings.Split(string(doc), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") && l != "---" {
			return false
		}
	}
	return true
}

// decode decodes m strictly into out.
func decode(t *testing.T, m manifest, out any) bool {
	t.Helper()
	if err := yaml.UnmarshalStrict(m.data, out); err != nil {
		t.Errorf("%s: %v", m.at, err)
		return false
	}
	return true
}

// deployment is the typed content of deploy/.
type deployment struct {
	crd                 map[string]any
	examples            []*RateLimit
	namespaces          []*corev1.Namespace
	serviceAccounts     []*corev1.ServiceAccount
	configMaps          []*corev1.ConfigMap
	daemonSets          []*appsv1.DaemonSet
	clusterRoles        []*rbacv1.ClusterRole
	clusterRoleBindings []*rbacv1.ClusterRoleBinding
	roles               []*rbacv1.Role
	roleBindings        []*rbacv1.RoleBinding
	policies            []*admissionregistrationv1.ValidatingAdmissionPolicy
	policyBindings      []*admissionregistrationv1.ValidatingAdmissionPolicyBinding
	// limiter are the manifests of deploy/limiter/: an application's RBAC
	// for the limiter library.
	limiter []manifest
	// monitoring are the manifests of deploy/monitoring/: Prometheus's
	// (TestMonitoring).
	monitoring []manifest
}

func readDeployment(t *testing.T) *deployment {
	t.Helper()
	var d deployment
	for _, m := range readManifests(t) {
		if strings.HasPrefix(m.at, "deploy/limiter/") {
			d.limiter = append(d.limiter, m) // an application's, not the agents': TestLimiterRBAC
			continue
		}
		if strings.HasPrefix(m.at, "deploy/monitoring/") {
			d.monitoring = append(d.monitoring, m) // Prometheus's, not the agents': TestMonitoring
			continue
		}
		switch m.gvk {
		case SchemeGroupVersion.WithKind("RateLimit"):
			if !strings.HasPrefix(m.at, "deploy/examples/") {
				t.Errorf("%s: RateLimits belong in deploy/examples/", m.at)
			}
			if x := new(RateLimit); decode(t, m, x) {
				d.examples = append(d.examples, x)
			}
		case schema.GroupVersionKind{Group: "apiextensions.k8s.io", Version: "v1", Kind: "CustomResourceDefinition"}:
			if d.crd != nil {
				t.Errorf("%s: a second CRD", m.at)
			}
			if m.at != "deploy/crd.yaml#0" {
				t.Errorf("%s: the CRD belongs in deploy/crd.yaml", m.at)
			}
			d.crd = map[string]any{}
			decode(t, m, &d.crd)
		case corev1.SchemeGroupVersion.WithKind("Namespace"):
			if x := new(corev1.Namespace); decode(t, m, x) {
				d.namespaces = append(d.namespaces, x)
			}
		case corev1.SchemeGroupVersion.WithKind("ServiceAccount"):
			if x := new(corev1.ServiceAccount); decode(t, m, x) {
				d.serviceAccounts = append(d.serviceAccounts, x)
			}
		case corev1.SchemeGroupVersion.WithKind("ConfigMap"):
			if x := new(corev1.ConfigMap); decode(t, m, x) {
				d.configMaps = append(d.configMaps, x)
			}
		case appsv1.SchemeGroupVersion.WithKind("DaemonSet"):
			if x := new(appsv1.DaemonSet); decode(t, m, x) {
				d.daemonSets = append(d.daemonSets, x)
			}
		case rbacv1.SchemeGroupVersion.WithKind("ClusterRole"):
			if x := new(rbacv1.ClusterRole); decode(t, m, x) {
				d.clusterRoles = append(d.clusterRoles, x)
			}
		case rbacv1.SchemeGroupVersion.WithKind("ClusterRoleBinding"):
			if x := new(rbacv1.ClusterRoleBinding); decode(t, m, x) {
				d.clusterRoleBindings = append(d.clusterRoleBindings, x)
			}
		case rbacv1.SchemeGroupVersion.WithKind("Role"):
			if x := new(rbacv1.Role); decode(t, m, x) {
				d.roles = append(d.roles, x)
			}
		case rbacv1.SchemeGroupVersion.WithKind("RoleBinding"):
			if x := new(rbacv1.RoleBinding); decode(t, m, x) {
				d.roleBindings = append(d.roleBindings, x)
			}
		case admissionregistrationv1.SchemeGroupVersion.WithKind("ValidatingAdmissionPolicy"):
			if x := new(admissionregistrationv1.ValidatingAdmissionPolicy); decode(t, m, x) {
				d.policies = append(d.policies, x)
			}
		case admissionregistrationv1.SchemeGroupVersion.WithKind("ValidatingAdmissionPolicyBinding"):
			if x := new(admissionregistrationv1.ValidatingAdmissionPolicyBinding); decode(t, m, x) {
				d.policyBindings = append(d.policyBindings, x)
			}
		default:
			t.Errorf("%s: unexpected %v: add it to this test, with checks", m.at, m.gvk)
		}
	}
	if d.crd == nil {
		t.Fatal("deploy/ has no CRD")
	}
	return &d
}

const agentNamespace = "rlagent-system"

// TestExamples checks that every RateLimit under deploy/examples/ is one the
// agents accept, and that together they show the fan-out: a per-source
// limit, a per-consumer limit (each downstream consumer its own bucket, as
// the packets leave) and a sampler (the stream into a sampler Service).
func TestExamples(t *testing.T) {
	d := readDeployment(t)
	var perSource, perConsumer, sampler bool
	names := map[string]bool{}
	for _, rl := range d.examples {
		if !isDNSLabel(rl.Name) {
			t.Errorf("RateLimit %q: the name is not a limit name", rl.Name)
		}
		if names[rl.Name] {
			t.Errorf("RateLimit %q: defined twice", rl.Name)
		}
		names[rl.Name] = true
		if rl.Namespace != "" {
			t.Errorf("RateLimit %q has a namespace: RateLimit is cluster-scoped", rl.Name)
		}
		if rl.Spec.Scope == "" {
			t.Errorf("RateLimit %q: scope is required in Kubernetes", rl.Name)
		}
		spec := *rl.Spec.DeepCopy()
		spec.Default()
		if err := spec.Validate("spec"); err != nil {
			t.Errorf("RateLimit %q is invalid:\n%v", rl.Name, err)
		}
		switch {
		case spec.Key == KeySrcIP || spec.Key == KeySrcPrefix:
			perSource = true
		case spec.Key == KeyDstIP && spec.Match.Direction == DirectionEgress:
			perConsumer = true
		case spec.Key == KeyNone && spec.Action == ActionDrop && strings.HasSuffix(spec.Match.Service, "sampler"):
			sampler = true
		}
	}
	if !perSource || !perConsumer || !sampler {
		t.Errorf("the examples lack a kind of limit: per-source %v, per-consumer %v, sampler %v", perSource, perConsumer, sampler)
	}
}

// path returns the value at the keys below m, or nil.
func path(m any, keys ...string) any {
	for _, k := range keys {
		mm, ok := m.(map[string]any)
		if !ok {
			return nil
		}
		m = mm[k]
	}
	return m
}

func strs[T ~string](vs ...T) []string {
	out := make([]string, len(vs))
	for i, v := range vs {
		out[i] = string(v)
	}
	return out
}

// TestCRD checks the generated CRD against the Go types: the markers in
// types.go state enums, bounds and defaults a second time, so they must
// agree with the constants, Default and the enum lists.
func TestCRD(t *testing.T) {
	crd := readDeployment(t).crd
	if got := path(crd, "metadata", "name"); got != "ratelimits."+GroupName {
		t.Errorf("name %v", got)
	}
	if got := path(crd, "spec", "scope"); got != "Cluster" {
		t.Errorf("scope %v, want Cluster", got)
	}
	versions, _ := path(crd, "spec", "versions").([]any)
	if len(versions) != 1 {
		t.Fatalf("%d versions, want 1", len(versions))
	}
	v := versions[0]
	if path(v, "name") != Version || path(v, "served") != true || path(v, "storage") != true {
		t.Errorf("version %v served %v storage %v", path(v, "name"), path(v, "served"), path(v, "storage"))
	}
	if path(v, "subresources", "status") == nil {
		t.Error("no status subresource")
	}
	var cols []string
	for _, c := range path(v, "additionalPrinterColumns").([]any) {
		cols = append(cols, path(c, "name").(string)+"="+path(c, "jsonPath").(string))
	}
	if want := []string{
		"Rate=.spec.rate", "Unit=.spec.unit", "Scope=.spec.scope", "Replicas=.status.replicas",
		`Accepted=.status.conditions[?(@.type=="Accepted")].status`, "Age=.metadata.creationTimestamp",
	}; !slices.Equal(cols, want) {
		t.Errorf("printer columns\n%q\nwant\n%q", cols, want)
	}

	spec := path(v, "schema", "openAPIV3Schema", "properties", "spec")
	prop := func(p string) any {
		keys := []string{}
		for _, k := range strings.Split(p, ".") {
			keys = append(keys, "properties", k)
		}
		return path(spec, keys...)
	}
	if got := path(spec, "required"); !reflect.DeepEqual(got, []any{"match", "rate", "scope"}) {
		t.Errorf("spec requires %v, want match, rate, scope", got)
	}

	// Each enum lists every value the Go type defines (including those the
	// agent rejects as not supported yet: the schema is the API, the agent
	// what this release implements).
	for field, want := range map[string][]string{
		"unit":            strs(Units...),
		"attach":          strs(Attaches...),
		"key":             strs(Keys...),
		"scope":           strs(Scopes...),
		"action":          strs(Actions...),
		"match.direction": strs(Directions...),
		"match.protocol":  strs(Protocols...),
	} {
		var got []string
		for _, e := range path(prop(field), "enum").([]any) {
			got = append(got, e.(string))
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s: enum %v, want %v", field, got, want)
		}
	}

	// The defaults are those Default applies to an empty spec, except scope:
	// its file default is no default in Kubernetes.
	var empty RateLimitSpec
	empty.Default()
	defaulted := map[string]any{}
	j, _ := yaml.Marshal(&empty)
	if err := yaml.Unmarshal(j, &defaulted); err != nil {
		t.Fatal(err)
	}
	for _, field := range []string{"unit", "key", "action", "match.direction", "match.protocol", "scope"} {
		got := path(prop(field), "default")
		want := path(defaulted, strings.Split(field, ".")...)
		if field == "scope" {
			want = nil
		}
		if got != want {
			t.Errorf("%s: CRD default %v, Default sets %v", field, got, want)
		}
	}

	num := func(field, bound string) float64 {
		f, _ := path(prop(field), bound).(float64)
		return f
	}
	for _, c := range []struct {
		field, bound string
		want         float64
	}{
		{"rate", "minimum", 1},
		{"rate", "maximum", MaxGlobalRate},
		{"burst", "minimum", 1},
		{"prefixLength.ipv4", "minimum", 1},
		{"prefixLength.ipv4", "maximum", 32},
		{"prefixLength.ipv6", "minimum", 1},
		{"prefixLength.ipv6", "maximum", 128},
	} {
		if got := num(c.field, c.bound); got != c.want {
			t.Errorf("%s: %s %v, want %v", c.field, c.bound, got, c.want)
		}
	}
	// The burst rule states MaxBurstSeconds and MaxGlobalRate again.
	var burstRule string
	for _, r := range path(spec, "x-kubernetes-validations").([]any) {
		if path(r, "fieldPath") == ".burst" {
			burstRule = path(r, "rule").(string)
		}
	}
	if !strings.Contains(burstRule, "self.rate * "+strconv.Itoa(MaxBurstSeconds)) ||
		!strings.Contains(burstRule, "self.rate > "+strconv.Itoa(MaxGlobalRate)) {
		t.Errorf("burst rule %q does not state MaxBurstSeconds %d and MaxGlobalRate %d", burstRule, MaxBurstSeconds, uint64(MaxGlobalRate))
	}
}

// TestDaemonSet checks the agent's security posture and its wiring to the
// config, the namespace and the ServiceAccount.
func TestDaemonSet(t *testing.T) {
	d := readDeployment(t)
	if len(d.daemonSets) != 1 || len(d.configMaps) != 1 || len(d.namespaces) != 1 || len(d.serviceAccounts) != 1 {
		t.Fatalf("want one DaemonSet, ConfigMap, Namespace and ServiceAccount; have %d, %d, %d, %d",
			len(d.daemonSets), len(d.configMaps), len(d.namespaces), len(d.serviceAccounts))
	}
	ds, cm, ns, sa := d.daemonSets[0], d.configMaps[0], d.namespaces[0], d.serviceAccounts[0]
	for _, o := range []metav1.Object{ds, cm, sa} {
		if o.GetNamespace() != agentNamespace {
			t.Errorf("%s is in namespace %q, want %q", o.GetName(), o.GetNamespace(), agentNamespace)
		}
	}
	if ns.Name != agentNamespace {
		t.Errorf("namespace %q, want %q", ns.Name, agentNamespace)
	}

	sel, err := metav1.LabelSelectorAsSelector(ds.Spec.Selector)
	if err != nil || sel.Empty() || !sel.Matches(labels.Set(ds.Spec.Template.Labels)) {
		t.Errorf("selector %v does not select the pod template's labels %v (%v)", ds.Spec.Selector, ds.Spec.Template.Labels, err)
	}
	if s := ds.Spec.UpdateStrategy; s.Type != appsv1.RollingUpdateDaemonSetStrategyType ||
		s.RollingUpdate == nil || s.RollingUpdate.MaxUnavailable == nil || s.RollingUpdate.MaxUnavailable.IntValue() != 1 {
		t.Errorf("update strategy %+v, want RollingUpdate with maxUnavailable 1", s)
	}

	pod := ds.Spec.Template.Spec
	if pod.ServiceAccountName != sa.Name {
		t.Errorf("serviceAccountName %q, want %q", pod.ServiceAccountName, sa.Name)
	}
	if !pod.HostNetwork || pod.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
		t.Errorf("hostNetwork %v, dnsPolicy %q: want true, ClusterFirstWithHostNet", pod.HostNetwork, pod.DNSPolicy)
	}
	if pod.HostPID || pod.HostIPC {
		t.Error("hostPID or hostIPC: the agent needs neither")
	}
	if !slices.ContainsFunc(pod.Tolerations, func(t corev1.Toleration) bool {
		return t.Operator == corev1.TolerationOpExists && t.Key == "" && t.Effect == ""
	}) {
		t.Errorf("tolerations %v do not tolerate every taint: the agent runs on every node", pod.Tolerations)
	}
	if pod.TerminationGracePeriodSeconds == nil {
		t.Error("no terminationGracePeriodSeconds")
	}
	if len(pod.InitContainers) != 0 || len(pod.Containers) != 1 {
		t.Fatalf("%d init containers and %d containers, want 0 and 1", len(pod.InitContainers), len(pod.Containers))
	}
	c := pod.Containers[0]

	sc := c.SecurityContext
	if sc == nil || sc.Privileged == nil || *sc.Privileged ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.Capabilities == nil {
		t.Fatalf("securityContext %+v: want privileged false, allowPrivilegeEscalation false, readOnlyRootFilesystem true and capabilities", sc)
	}
	add := strs(sc.Capabilities.Add...)
	slices.Sort(add)
	if want := []string{"BPF", "NET_ADMIN", "PERFMON"}; !slices.Equal(add, want) {
		t.Errorf("capabilities add %v, want exactly %v", add, want)
	}
	if drop := strs(sc.Capabilities.Drop...); !slices.Equal(drop, []string{"ALL"}) {
		t.Errorf("capabilities drop %v, want [ALL]", drop)
	}

	if want := []string{"run", "--config", "/etc/rlagent/rlagent.yaml"}; !slices.Equal(c.Args, want) {
		t.Errorf("args %q, want %q", c.Args, want)
	}
	env := map[string]string{}
	for _, e := range c.Env {
		if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			env[e.Name] = e.ValueFrom.FieldRef.FieldPath
		}
	}
	if env["NODE_NAME"] != "spec.nodeName" || env["POD_NAMESPACE"] != "metadata.namespace" {
		t.Errorf("downward API env %v: want NODE_NAME from spec.nodeName, POD_NAMESPACE from metadata.namespace", env)
	}
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		req, lim := c.Resources.Requests[r], c.Resources.Limits[r]
		if req.IsZero() || lim.IsZero() || req.Cmp(lim) > 0 {
			t.Errorf("%s: request %v, limit %v: want both, request <= limit", r, &req, &lim)
		}
	}

	// The config the agent runs with: valid, without limits.
	cfg, err := ParseConfig([]byte(cm.Data["rlagent.yaml"]))
	if err != nil {
		t.Fatalf("ConfigMap %s, rlagent.yaml: %v", cm.Name, err)
	}
	if len(cfg.Limits) != 0 {
		t.Errorf("the ConfigMap lists limits: in a cluster they are RateLimit objects")
	}

	// The volumes: the node's pin directory (/sys/fs/bpf/rlagent, not the
	// whole BPF filesystem) at the config's pinDir, and the config from the
	// ConfigMap.
	mounts := map[string]corev1.VolumeMount{}
	for _, m := range c.VolumeMounts {
		mounts[m.Name] = m
	}
	var pins, config bool
	for _, v := range pod.Volumes {
		m, mounted := mounts[v.Name]
		switch {
		case v.HostPath != nil && v.HostPath.Path == DefaultPinDir:
			if v.HostPath.Type == nil || *v.HostPath.Type != corev1.HostPathDirectoryOrCreate || !mounted || m.ReadOnly {
				t.Errorf("pin volume %q %+v mounted %+v: want %s (DirectoryOrCreate), mounted writable", v.Name, v.HostPath, m, DefaultPinDir)
			}
			if m.MountPath != cfg.PinDir {
				t.Errorf("pin volume %q is mounted at %q, but the agent pins in pinDir %q", v.Name, m.MountPath, cfg.PinDir)
			}
			// The container has a sysfs of its own at /sys, on which the
			// runtime cannot create a mount point such as
			// /sys/fs/bpf/rlagent: the pod would never start.
			if m.MountPath == "/sys" || strings.HasPrefix(m.MountPath, "/sys/") {
				t.Errorf("pin volume %q is mounted at %q: below /sys the runtime cannot create the mount point", v.Name, m.MountPath)
			}
			if m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional {
				t.Errorf("volume %q: Bidirectional mount propagation needs a privileged container", v.Name)
			}
			pins = true
		case v.HostPath != nil:
			// Only the pin directory: the agent has no business with
			// other programs' pins or other host files (the lock file's
			// directory, when there is one, is added here with a check).
			t.Errorf("hostPath volume %q %+v: the agent mounts only %s from the host", v.Name, v.HostPath, DefaultPinDir)
		case v.ConfigMap != nil:
			if v.ConfigMap.Name != cm.Name || !mounted || m.MountPath != "/etc/rlagent" || !m.ReadOnly || m.SubPath != "" {
				t.Errorf("config volume %q %+v mounted %+v: want ConfigMap %q read-only at /etc/rlagent, no subPath (it would not see edits)", v.Name, v.ConfigMap, m, cm.Name)
			}
			config = true
		default:
			t.Errorf("volume %q: unexpected kind", v.Name)
		}
	}
	if !pins || !config {
		t.Errorf("volumes: hostPath %s %v, config %v", DefaultPinDir, pins, config)
	}

	// Metrics and the health endpoints on loopback only: the pod shares
	// the node's network, so any other address serves them to the node's
	// networks. The probes ask that address (the kubelet runs in the
	// node's network namespace), on the metrics port.
	host, port, err := net.SplitHostPort(cfg.MetricsAddress)
	if ip := net.ParseIP(host); err != nil || ip == nil || !ip.IsLoopback() {
		t.Errorf("metricsAddress %q: want a loopback address (127.0.0.1:PORT): on hostNetwork any other serves the node's networks", cfg.MetricsAddress)
	}
	var metricsPort *corev1.ContainerPort
	for i, p := range c.Ports {
		if strconv.Itoa(int(p.ContainerPort)) == port {
			metricsPort = &c.Ports[i]
		}
	}
	if metricsPort == nil {
		t.Fatalf("no container port for metricsAddress %q", cfg.MetricsAddress)
	}
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{{"readiness", c.ReadinessProbe, "/readyz"}, {"liveness", c.LivenessProbe, "/livez"}} {
		pr := p.probe
		if pr == nil || pr.HTTPGet == nil || pr.HTTPGet.Path != p.path || pr.HTTPGet.Host != host ||
			(pr.HTTPGet.Port.String() != metricsPort.Name && pr.HTTPGet.Port.String() != port) {
			t.Errorf("%s probe %+v: want httpGet %s on %s, the metrics address", p.name, pr, p.path, net.JoinHostPort(host, port))
		}
	}
	// The lock record names the pod holding the pin directory.
	var podName bool
	for _, e := range c.Env {
		podName = podName || (e.Name == "POD_NAME" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.name")
	}
	if !podName {
		t.Errorf("env: want POD_NAME from metadata.name, for the pin directory's lock record")
	}

	if ns.Labels["pod-security.kubernetes.io/enforce"] != "privileged" {
		t.Errorf("namespace %s: the agent's pod needs the privileged Pod Security level (hostNetwork, hostPath, capabilities)", ns.Name)
	}
}

// TestRBAC checks that the agents get exactly the rights docs/kubernetes.md
// lists: read RateLimits, EndpointSlices, pods and namespaces, write
// RateLimit status only; in their namespace read their DaemonSet, hold the
// status writer's Lease and write and read the demand Leases (which of them
// an agent may write, RBAC cannot say: TestDeployDemandPolicy); in default
// create Events (those of RateLimits), which nothing reads back.
func TestRBAC(t *testing.T) {
	d := readDeployment(t)
	if len(d.clusterRoles) != 1 || len(d.roles) != 2 || len(d.clusterRoleBindings) != 1 || len(d.roleBindings) != 2 || len(d.serviceAccounts) != 1 {
		t.Fatalf("want one ClusterRole, ClusterRoleBinding and ServiceAccount, two Roles and RoleBindings")
	}
	read := []string{"get", "list", "watch"}
	if want := []rbacv1.PolicyRule{
		{APIGroups: []string{GroupName}, Resources: []string{"ratelimits"}, Verbs: read},
		{APIGroups: []string{GroupName}, Resources: []string{"ratelimits/status"}, Verbs: []string{"update", "patch"}},
		{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: read},
		// scope pods: its node's pods, the namespaces' labels; the
		// elected agent counts every pod.
		{APIGroups: []string{""}, Resources: []string{"pods", "namespaces"}, Verbs: read},
		// secureMetrics' reviews of each scrape.
		{APIGroups: []string{"authentication.k8s.io"}, Resources: []string{"tokenreviews"}, Verbs: []string{"create"}},
		{APIGroups: []string{"authorization.k8s.io"}, Resources: []string{"subjectaccessreviews"}, Verbs: []string{"create"}},
	}; !reflect.DeepEqual(d.clusterRoles[0].Rules, want) {
		t.Errorf("ClusterRole rules\n%+v\nwant\n%+v", d.clusterRoles[0].Rules, want)
	}
	ds := "rlagent"
	if len(d.daemonSets) == 1 {
		ds = d.daemonSets[0].Name
	}
	want := map[string][]rbacv1.PolicyRule{
		agentNamespace: {
			{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{ds}, Verbs: read},
			{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"create", "get", "update", "list", "watch"}},
		},
		"default": {
			// No list or watch: Events are output; the nodes' verdicts
			// are read from their Leases.
			{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
		},
	}
	sa := d.serviceAccounts[0]
	subject := []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa.Name, Namespace: sa.Namespace}}
	for _, role := range d.roles {
		rules, ok := want[role.Namespace]
		if !ok {
			t.Errorf("Role %s in %q, want one in %q and one in default", role.Name, role.Namespace, agentNamespace)
			continue
		}
		delete(want, role.Namespace)
		if !reflect.DeepEqual(role.Rules, rules) {
			t.Errorf("Role %s/%s rules\n%+v\nwant\n%+v", role.Namespace, role.Name, role.Rules, rules)
		}
		bound := false
		for _, rb := range d.roleBindings {
			bound = bound || rb.Namespace == role.Namespace &&
				rb.RoleRef == (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: role.Name}) &&
				reflect.DeepEqual(rb.Subjects, subject)
		}
		if !bound {
			t.Errorf("no RoleBinding binds the Role %s/%s to %+v", role.Namespace, role.Name, subject)
		}
	}
	crb := d.clusterRoleBindings[0]
	if crb.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: d.clusterRoles[0].Name}) ||
		!reflect.DeepEqual(crb.Subjects, subject) {
		t.Errorf("ClusterRoleBinding %+v does not bind the ClusterRole to %+v", crb, subject)
	}
}

// TestKustomization checks that `kubectl apply -k deploy/` installs every
// manifest of deploy/ but the examples.
func TestKustomization(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(deployDir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		APIVersion string   `json:"apiVersion"`
		Kind       string   `json:"kind"`
		Resources  []string `json:"resources"`
		Images     []struct {
			Name    string `json:"name"`
			NewName string `json:"newName,omitempty"`
			NewTag  string `json:"newTag,omitempty"`
		} `json:"images"`
	}
	if err := yaml.UnmarshalStrict(data, &k); err != nil {
		t.Fatal(err)
	}
	files, _ := filepath.Glob(filepath.Join(deployDir, "*.yaml"))
	var want []string
	for _, f := range files {
		if b := filepath.Base(f); b != "kustomization.yaml" {
			want = append(want, b)
		}
	}
	got := slices.Clone(k.Resources)
	slices.Sort(got)
	// (The order does not matter: kustomize puts namespaces and CRDs first.)
	if k.Kind != "Kustomization" || !slices.Equal(got, want) {
		t.Errorf("kustomization %s lists %v, want every manifest in deploy/: %v", k.Kind, k.Resources, want)
	}
}

// TestDeployDemandPolicy checks the admission policy that does what the
// Role cannot: it keeps the agents' writes of Leases other than
// rlagent-status to their own node's demand Lease. Here: that it is bound
// to deny, and to what it applies; what it admits and denies is tested
// against a real API server (test/k8s, TestDemandLeasePolicy).
func TestDeployDemandPolicy(t *testing.T) {
	d := readDeployment(t)
	p, b, sa := d.policy(t, "rlagent-demand-leases")
	// Warn or Audit alone would let an agent write any node's Lease.
	if b.Spec.PolicyName != p.Name || !slices.Equal(b.Spec.ValidationActions, []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}) {
		t.Errorf("binding %s: policy %q, actions %v; want policy %q, actions [Deny]", b.Name, b.Spec.PolicyName, b.Spec.ValidationActions, p.Name)
	}
	if b.Spec.ParamRef != nil || b.Spec.MatchResources != nil {
		t.Errorf("binding %s narrows or parameterizes the policy (paramRef %+v, matchResources %+v): the policy states what it applies to", b.Name, b.Spec.ParamRef, b.Spec.MatchResources)
	}
	if fp := p.Spec.FailurePolicy; fp != nil && *fp != admissionregistrationv1.Fail {
		t.Errorf("failurePolicy %s: a policy that cannot be evaluated must deny, want Fail", *fp)
	}

	mc := p.Spec.MatchConstraints
	if mc == nil {
		t.Fatal("the policy has no matchConstraints")
	}
	want := []admissionregistrationv1.NamedRuleWithOperations{{RuleWithOperations: admissionregistrationv1.RuleWithOperations{
		Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update},
		Rule: admissionregistrationv1.Rule{
			APIGroups: []string{"coordination.k8s.io"}, APIVersions: []string{"v1"}, Resources: []string{"leases"},
		},
	}}}
	if !reflect.DeepEqual(mc.ResourceRules, want) || len(mc.ExcludeResourceRules) != 0 {
		t.Errorf("resource rules %+v (excluded %+v), want %+v", mc.ResourceRules, mc.ExcludeResourceRules, want)
	}
	if want := (&metav1.LabelSelector{MatchLabels: map[string]string{corev1.LabelMetadataName: sa.Namespace}}); !reflect.DeepEqual(mc.NamespaceSelector, want) {
		t.Errorf("namespace selector %+v, want %+v: the agents' namespace", mc.NamespaceSelector, want)
	}

	// The agents' own writes only, and not the status writer's election.
	user := "'system:serviceaccount:" + sa.Namespace + ":" + sa.Name + "'"
	var byUser, notStatus bool
	for _, c := range p.Spec.MatchConditions {
		byUser = byUser || c.Expression == "request.userInfo.username == "+user
		notStatus = notStatus || c.Expression == "object.metadata.name != 'rlagent-status'"
	}
	if !byUser || !notStatus {
		t.Errorf("match conditions %+v: want the username %s and the names but rlagent-status", p.Spec.MatchConditions, user)
	}
	var claim, name, holder bool
	for _, v := range p.Spec.Variables {
		claim = claim || strings.Contains(v.Expression, "request.userInfo.?extra[?'authentication.kubernetes.io/node-name']")
	}
	for _, v := range p.Spec.Validations {
		name = name || strings.Contains(v.Expression, "object.metadata.name == 'rlagent-demand-' + variables.node")
		holder = holder || strings.Contains(v.Expression, "variables.holder == variables.node")
		if v.Message == "" && v.MessageExpression == "" {
			t.Errorf("validation %q has no message: the default names the expression, not what is expected", v.Expression)
		}
	}
	if !claim || !name || !holder {
		t.Errorf("the policy does not read the node-name claim (%v), check the name (%v) or the holder (%v)", claim, name, holder)
	}
}

// policy returns the ValidatingAdmissionPolicy name, its one binding and
// the agents' ServiceAccount.
func (d *deployment) policy(t *testing.T, name string) (*admissionregistrationv1.ValidatingAdmissionPolicy, *admissionregistrationv1.ValidatingAdmissionPolicyBinding, *corev1.ServiceAccount) {
	t.Helper()
	if len(d.serviceAccounts) != 1 {
		t.Fatalf("%d ServiceAccounts, want one", len(d.serviceAccounts))
	}
	var p *admissionregistrationv1.ValidatingAdmissionPolicy
	var b *admissionregistrationv1.ValidatingAdmissionPolicyBinding
	for _, x := range d.policies {
		if x.Name == name {
			p = x
		}
	}
	for _, x := range d.policyBindings {
		if x.Spec.PolicyName == name {
			if b != nil {
				t.Errorf("policy %s: a second binding %s", name, x.Name)
			}
			b = x
		}
	}
	if p == nil || b == nil {
		t.Fatalf("no ValidatingAdmissionPolicy %s with a binding (policy %v, binding %v)", name, p != nil, b != nil)
	}
	return p, b, d.serviceAccounts[0]
}

// TestDeployStatusPolicy checks the admission policies that keep the
// RateLimits' status, the demand allocation among it, to the agent that
// holds the Lease rlagent-status, and that Lease to its holder's name: that
// they are bound to deny, to what they apply and what they read. What they
// admit and deny is tested against a real API server (test/k8s,
// TestStatusWriterPolicy).
func TestDeployStatusPolicy(t *testing.T) {
	d := readDeployment(t)
	if n := len(d.policies); n != 3 || len(d.policyBindings) != 3 {
		t.Errorf("%d policies and %d bindings, want 3 and 3: rlagent-demand-leases, rlagent-status-lease, rlagent-status-writer", n, len(d.policyBindings))
	}
	for _, name := range []string{"rlagent-status-lease", "rlagent-status-writer"} {
		p, b, sa := d.policy(t, name)
		if !slices.Equal(b.Spec.ValidationActions, []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}) {
			t.Errorf("binding %s: actions %v, want [Deny]", b.Name, b.Spec.ValidationActions)
		}
		if fp := p.Spec.FailurePolicy; fp == nil || *fp != admissionregistrationv1.Fail {
			t.Errorf("%s: failurePolicy %v, want Fail", name, fp)
		}
		user := "request.userInfo.username == 'system:serviceaccount:" + sa.Namespace + ":" + sa.Name + "'"
		if len(p.Spec.MatchConditions) == 0 || p.Spec.MatchConditions[0].Expression != user {
			t.Errorf("%s: match conditions %+v: want the agents' username first (%s)", name, p.Spec.MatchConditions, user)
		}
		var claim bool
		for _, v := range p.Spec.Variables {
			claim = claim || strings.Contains(v.Expression, "request.userInfo.?extra[?'authentication.kubernetes.io/pod-name']")
		}
		if !claim {
			t.Errorf("%s: does not read the pod-name claim", name)
		}
		for _, v := range p.Spec.Validations {
			if v.Message == "" && v.MessageExpression == "" {
				t.Errorf("%s: validation %q has no message", name, v.Expression)
			}
		}
		rules := p.Spec.MatchConstraints.ResourceRules
		switch name {
		case "rlagent-status-lease":
			if len(rules) != 1 || !slices.Equal(rules[0].Resources, []string{"leases"}) ||
				!reflect.DeepEqual(p.Spec.MatchConstraints.NamespaceSelector, &metav1.LabelSelector{MatchLabels: map[string]string{corev1.LabelMetadataName: sa.Namespace}}) {
				t.Errorf("%s: resource rules %+v in %+v, want leases in %s", name, rules, p.Spec.MatchConstraints.NamespaceSelector, sa.Namespace)
			}
			if !slices.ContainsFunc(p.Spec.MatchConditions, func(c admissionregistrationv1.MatchCondition) bool {
				return c.Expression == "object.metadata.name == 'rlagent-status'"
			}) {
				t.Errorf("%s: not limited to the Lease rlagent-status", name)
			}
		case "rlagent-status-writer":
			if len(rules) != 1 || !slices.Equal(rules[0].Resources, []string{"ratelimits/status"}) || !slices.Equal(rules[0].APIGroups, []string{GroupName}) {
				t.Errorf("%s: resource rules %+v, want ratelimits/status", name, rules)
			}
			if pk := p.Spec.ParamKind; pk == nil || pk.APIVersion != "coordination.k8s.io/v1" || pk.Kind != "Lease" {
				t.Errorf("%s: paramKind %+v, want coordination.k8s.io/v1 Lease", name, pk)
			}
			if r := b.Spec.ParamRef; r == nil || r.Name != "rlagent-status" || r.Namespace != sa.Namespace {
				t.Errorf("binding %s: paramRef %+v, want the Lease %s/rlagent-status", b.Name, r, sa.Namespace)
			}
			var holder, round bool
			for _, v := range p.Spec.Validations {
				holder = holder || strings.Contains(v.Expression, "variables.pod == variables.holder")
				round = round || strings.Contains(v.Expression, "variables.wasRound.value() + 1")
			}
			if !holder || !round {
				t.Errorf("%s: checks the holder %v, the round %v; want both", name, holder, round)
			}
		}
	}
}

// TestCRDDecodes checks that every object the API server admits decodes
// into the Go types: every integer field of the RateLimit (spec and status)
// has a schema whose minimum and maximum fit the Go type. The agents read
// RateLimits through a typed client, which decodes a list whole: one object
// with a value its Go field cannot hold (a negative status.allocation.demand
// written by a compromised status writer, a rate above 2^32 in a uint32
// field) would fail every agent's list and watch, and with them the updates
// that would carry the fix.
func TestCRDDecodes(t *testing.T) {
	crd := readDeployment(t).crd
	versions, _ := path(crd, "spec", "versions").([]any)
	if len(versions) != 1 {
		t.Fatalf("%d versions, want 1", len(versions))
	}
	root, _ := path(versions[0], "schema", "openAPIV3Schema").(map[string]any)
	checked := 0
	var walk func(at string, typ reflect.Type, schema map[string]any)
	walk = func(at string, typ reflect.Type, schema map[string]any) {
		for typ.Kind() == reflect.Pointer {
			typ = typ.Elem()
		}
		if schema == nil {
			t.Errorf("%s: no schema for the Go field (%s)", at, typ)
			return
		}
		switch typ.Kind() {
		case reflect.Struct:
			if typ.PkgPath() != reflect.TypeFor[RateLimit]().PkgPath() {
				return // metav1's types: the API server's own
			}
			props, _ := schema["properties"].(map[string]any)
			for i := range typ.NumField() {
				f := typ.Field(i)
				name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
				if f.Anonymous && name == "" {
					walk(at, f.Type, schema)
					continue
				}
				if name == "" || name == "-" {
					continue
				}
				sub, _ := props[name].(map[string]any)
				walk(at+"."+name, f.Type, sub)
			}
		case reflect.Slice:
			if typ.Elem().Kind() != reflect.Uint8 {
				sub, _ := schema["items"].(map[string]any)
				walk(at+"[]", typ.Elem(), sub)
			}
		case reflect.Map:
			sub, _ := schema["additionalProperties"].(map[string]any)
			walk(at+"{}", typ.Elem(), sub)
		case reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64, reflect.Int,
			reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uint:
			checked++
			lo, hi := intRange(typ)
			minimum, hasMin := number(schema["minimum"])
			maximum, hasMax := number(schema["maximum"])
			if lo > -(1<<63) && (!hasMin || minimum < lo) {
				t.Errorf("%s (%s): minimum %v (set %v), want at least %v", at, typ, minimum, hasMin, lo)
			}
			if hi < 1<<63-1 && (!hasMax || maximum > hi) {
				t.Errorf("%s (%s): maximum %v (set %v), want at most %v", at, typ, maximum, hasMax, hi)
			}
		}
	}
	walk("", reflect.TypeFor[RateLimit](), root)
	if checked < 10 {
		t.Errorf("checked %d integer fields: the walk lost its way", checked)
	}
}

// intRange is the range of an integer type, bounded by int64's (the
// largest integer the API server stores).
func intRange(typ reflect.Type) (lo, hi float64) {
	bits := typ.Bits()
	switch typ.Kind() {
	case reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uint:
		return 0, min(float64(uint64(1)<<bits-1), 1<<63-1)
	}
	return -float64(uint64(1) << (bits - 1)), float64(uint64(1)<<(bits-1) - 1)
}

func number(v any) (float64, bool) {
	switch n := v.(type) {
	case float64:
		return n, true
	case int64:
		return float64(n), true
	case int:
		return float64(n), true
	}
	return 0, false
}

// TestLimiterRBAC checks that an application using the limiter library
// gets exactly what docs/library.md lists: read RateLimits, and list and
// watch EndpointSlices in its own namespace; nothing else, and no write.
// What that lets it do on a real API server: test/k8s' TestLimiterRBAC.
func TestLimiterRBAC(t *testing.T) {
	d := readDeployment(t)
	var crs []*rbacv1.ClusterRole
	var roles []*rbacv1.Role
	var crbs []*rbacv1.ClusterRoleBinding
	var rbs []*rbacv1.RoleBinding
	var sas []*corev1.ServiceAccount
	for _, m := range d.limiter {
		switch m.gvk.Kind {
		case "ClusterRole":
			if x := new(rbacv1.ClusterRole); decode(t, m, x) {
				crs = append(crs, x)
			}
		case "Role":
			if x := new(rbacv1.Role); decode(t, m, x) {
				roles = append(roles, x)
			}
		case "ClusterRoleBinding":
			if x := new(rbacv1.ClusterRoleBinding); decode(t, m, x) {
				crbs = append(crbs, x)
			}
		case "RoleBinding":
			if x := new(rbacv1.RoleBinding); decode(t, m, x) {
				rbs = append(rbs, x)
			}
		case "ServiceAccount":
			if x := new(corev1.ServiceAccount); decode(t, m, x) {
				sas = append(sas, x)
			}
		default:
			t.Errorf("%s: unexpected %v in deploy/limiter/", m.at, m.gvk)
		}
	}
	if len(crs) != 1 || len(roles) != 1 || len(crbs) != 1 || len(rbs) != 1 || len(sas) != 1 {
		t.Fatalf("deploy/limiter/: want one ClusterRole, Role, ClusterRoleBinding, RoleBinding and ServiceAccount")
	}
	if want := []rbacv1.PolicyRule{{APIGroups: []string{GroupName}, Resources: []string{"ratelimits"}, Verbs: []string{"get", "list", "watch"}}}; !reflect.DeepEqual(crs[0].Rules, want) {
		t.Errorf("ClusterRole rules %+v, want %+v", crs[0].Rules, want)
	}
	if want := []rbacv1.PolicyRule{{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}}}; !reflect.DeepEqual(roles[0].Rules, want) {
		t.Errorf("Role rules %+v, want %+v", roles[0].Rules, want)
	}
	sa := sas[0]
	subject := []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa.Name, Namespace: sa.Namespace}}
	if roles[0].Namespace != sa.Namespace || rbs[0].Namespace != sa.Namespace {
		t.Errorf("the Role (%s) and its binding (%s) are not in the application's namespace %s", roles[0].Namespace, rbs[0].Namespace, sa.Namespace)
	}
	if rbs[0].RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: roles[0].Name}) || !reflect.DeepEqual(rbs[0].Subjects, subject) {
		t.Errorf("RoleBinding %+v does not bind the Role to %+v", rbs[0], subject)
	}
	if crbs[0].RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: crs[0].Name}) || !reflect.DeepEqual(crbs[0].Subjects, subject) {
		t.Errorf("ClusterRoleBinding %+v does not bind the ClusterRole to %+v", crbs[0], subject)
	}
}
