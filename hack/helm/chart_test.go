package main

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v4/pkg/action"
	"helm.sh/helm/v4/pkg/chart/v2/lint/support"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/rlagent/rlagent/api/v1alpha1"
)

// These tests check the chart without a cluster: the Helm SDK's lint, a
// rendering with values other than the defaults decoded strictly into the
// Kubernetes types (an unknown or misspelled field fails) with the agent's
// own config parser reading the ConfigMap, wrong values refused by
// values.schema.json with the field named, and deploy/ being the default
// rendering. The default rendering's meaning (RBAC, security posture,
// policies) is tested where deploy/ is, in api/v1alpha1/deploy_test.go;
// that a cluster runs it, by test/node (this command's install).

const repo = "../.."

var chart = filepath.Join(repo, chartDir)

// nonDefault are values other than every default that changes what the
// chart renders.
func nonDefault() map[string]any {
	return map[string]any{
		"image": map[string]any{
			"repository": "registry.example.com/team/rlagent",
			"tag":        "ignored-with-a-digest",
			"digest":     "sha256:" + strings.Repeat("ab", 32),
			"pullPolicy": "Always",
		},
		"config": map[string]any{
			"interfaces":          []any{"eth0", "bond0"},
			"xdpFallback":         "tc",
			"endpointHook":        "pod",
			"endpointSourceCheck": "drop",
			"protect": []any{
				map[string]any{"name": "ssh", "protocol": "tcp", "peers": []any{"10.0.0.0/8", "fd00::/8"}, "localPorts": []any{22, "2222-2223"}},
			},
			"demandShares": map[string]any{"interval": "30s", "floorPerMille": 5},
			"maxBuckets":   131072,
			"extra":        map[string]any{"manageQdisc": true, "rejectBudget": map[string]any{"rate": 100}},
		},
		"metrics": map[string]any{
			"port":   9500,
			"secure": map[string]any{"enabled": true, "port": 9501, "certSecret": "rlagent-metrics-tls"},
			"serviceMonitor": map[string]any{
				"enabled": true, "labels": map[string]any{"release": "prometheus"}, "interval": "30s",
				"tlsConfig": map[string]any{"serverName": "rlagent-metrics.net-limits.svc",
					"ca": map[string]any{"secret": map[string]any{"name": "rlagent-metrics-tls", "key": "ca.crt"}}},
			},
		},
		"readinessProbe":    map[string]any{"periodSeconds": 2, "failureThreshold": 1},
		"resources":         map[string]any{"requests": map[string]any{"cpu": "100m", "memory": "128Mi"}, "limits": map[string]any{"memory": "256Mi"}},
		"tolerations":       []any{map[string]any{"key": "dedicated", "operator": "Equal", "value": "edge", "effect": "NoSchedule"}},
		"nodeSelector":      map[string]any{"kubernetes.io/os": "linux"},
		"affinity":          map[string]any{"nodeAffinity": map[string]any{"requiredDuringSchedulingIgnoredDuringExecution": map[string]any{"nodeSelectorTerms": []any{map[string]any{"matchExpressions": []any{map[string]any{"key": "edge", "operator": "Exists"}}}}}}},
		"priorityClassName": "",
		"podAnnotations":    map[string]any{"example.com/owner": "network"},
		"updateStrategy":    map[string]any{"type": "RollingUpdate", "rollingUpdate": map[string]any{"maxUnavailable": "10%"}},
	}
}

// TestLint runs the Helm SDK's lint (helm lint --strict) on the chart with
// the default values and with nonDefault's.
func TestLint(t *testing.T) {
	for name, vals := range map[string]map[string]any{"defaults": nil, "nonDefault": nonDefault()} {
		l := action.NewLint()
		l.Strict = true
		l.Namespace = releaseNamespace
		r := l.Run([]string{chart}, vals)
		for _, m := range r.Messages {
			t.Logf("%s: %v", name, m)
			if m.Severity >= support.WarningSev {
				t.Errorf("%s: %v", name, m)
			}
		}
		for _, err := range r.Errors {
			t.Errorf("%s: %v", name, err)
		}
		if r.TotalChartsLinted != 1 {
			t.Errorf("%s: linted %d charts, want 1", name, r.TotalChartsLinted)
		}
	}
}

// object is one rendered document.
type object struct {
	at   string // templates/rbac.yaml#2
	gvk  schema.GroupVersionKind
	name string
	data []byte
}

// objects splits the rendered templates into their documents.
func objects(t *testing.T, files map[string]string) []object {
	t.Helper()
	var out []object
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		if !strings.HasSuffix(n, ".yaml") {
			continue
		}
		r := utilyaml.NewYAMLReader(bufio.NewReader(strings.NewReader(files[n])))
		for i := 0; ; i++ {
			doc, err := r.Read()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("%s: %v", n, err)
			}
			var head struct {
				metav1.TypeMeta   `json:",inline"`
				metav1.ObjectMeta `json:"metadata"`
			}
			if err := yaml.Unmarshal(doc, &head); err != nil {
				t.Fatalf("%s#%d: %v", n, i, err)
			}
			if head.Kind == "" {
				continue // a document of comments, or an empty one
			}
			out = append(out, object{at: n + "#" + strconv.Itoa(i), gvk: head.GroupVersionKind(), name: head.Name, data: doc})
		}
	}
	return out
}

// rendered is a rendering's objects, decoded.
type rendered struct {
	objects         []object
	daemonSet       *appsv1.DaemonSet
	configMap       *corev1.ConfigMap
	config          *v1alpha1.Config
	clusterRoles    map[string]*rbacv1.ClusterRole
	policies        []*admissionregistrationv1.ValidatingAdmissionPolicy
	policyBindings  []*admissionregistrationv1.ValidatingAdmissionPolicyBinding
	services        []*corev1.Service
	serviceMonitors []*monitoringv1.ServiceMonitor
	namespaces      []*corev1.Namespace
}

// decodeAll decodes every object strictly into its type: a field the type
// lacks (misspelled, or in the wrong place) is an error, as it is for the
// API server's strict field validation.
func decodeAll(t *testing.T, objs []object) *rendered {
	t.Helper()
	r := &rendered{objects: objs, clusterRoles: map[string]*rbacv1.ClusterRole{}}
	for _, o := range objs {
		var into any
		switch o.gvk {
		case appsv1.SchemeGroupVersion.WithKind("DaemonSet"):
			r.daemonSet = new(appsv1.DaemonSet)
			into = r.daemonSet
		case corev1.SchemeGroupVersion.WithKind("ConfigMap"):
			r.configMap = new(corev1.ConfigMap)
			into = r.configMap
		case corev1.SchemeGroupVersion.WithKind("Namespace"):
			x := new(corev1.Namespace)
			r.namespaces, into = append(r.namespaces, x), x
		case corev1.SchemeGroupVersion.WithKind("ServiceAccount"):
			into = new(corev1.ServiceAccount)
		case corev1.SchemeGroupVersion.WithKind("Service"):
			x := new(corev1.Service)
			r.services, into = append(r.services, x), x
		case rbacv1.SchemeGroupVersion.WithKind("ClusterRole"):
			x := new(rbacv1.ClusterRole)
			r.clusterRoles[o.name], into = x, x
		case rbacv1.SchemeGroupVersion.WithKind("ClusterRoleBinding"):
			into = new(rbacv1.ClusterRoleBinding)
		case rbacv1.SchemeGroupVersion.WithKind("Role"):
			into = new(rbacv1.Role)
		case rbacv1.SchemeGroupVersion.WithKind("RoleBinding"):
			into = new(rbacv1.RoleBinding)
		case admissionregistrationv1.SchemeGroupVersion.WithKind("ValidatingAdmissionPolicy"):
			x := new(admissionregistrationv1.ValidatingAdmissionPolicy)
			r.policies, into = append(r.policies, x), x
		case admissionregistrationv1.SchemeGroupVersion.WithKind("ValidatingAdmissionPolicyBinding"):
			x := new(admissionregistrationv1.ValidatingAdmissionPolicyBinding)
			r.policyBindings, into = append(r.policyBindings, x), x
		case monitoringv1.SchemeGroupVersion.WithKind("ServiceMonitor"):
			x := new(monitoringv1.ServiceMonitor)
			r.serviceMonitors, into = append(r.serviceMonitors, x), x
		default:
			t.Errorf("%s: unexpected %v: add it to this test, with checks", o.at, o.gvk)
			continue
		}
		if err := yaml.UnmarshalStrict(o.data, into); err != nil {
			t.Errorf("%s (%s %s): %v", o.at, o.gvk.Kind, o.name, err)
		}
	}
	if r.configMap != nil {
		cfg, err := v1alpha1.ParseConfig([]byte(r.configMap.Data["rlagent.yaml"]))
		if err != nil {
			t.Errorf("the ConfigMap's rlagent.yaml does not parse with the agent's parser: %v\n%s", err, r.configMap.Data["rlagent.yaml"])
		}
		r.config = cfg
	}
	return r
}

func render(t *testing.T, vals map[string]any, namespace string) *rendered {
	t.Helper()
	files, err := renderChart(chart, vals, "rl", namespace)
	if err != nil {
		t.Fatal(err)
	}
	return decodeAll(t, objects(t, files))
}

// TestRenderNonDefault renders nonDefault's values in another namespace
// and checks that each value reached the object it is for.
func TestRenderNonDefault(t *testing.T) {
	const ns = "net-limits"
	r := render(t, nonDefault(), ns)
	if r.daemonSet == nil || r.configMap == nil || r.config == nil {
		t.Fatalf("no DaemonSet, ConfigMap or config (%v, %v, %v)", r.daemonSet != nil, r.configMap != nil, r.config != nil)
	}
	if len(r.namespaces) != 0 {
		t.Errorf("a Namespace without namespace.create: Helm keeps its release in the namespace, which must exist first")
	}
	for _, o := range r.objects {
		var meta struct {
			metav1.ObjectMeta `json:"metadata"`
		}
		yaml.Unmarshal(o.data, &meta)
		if meta.Namespace != "" && meta.Namespace != ns && meta.Namespace != "default" {
			t.Errorf("%s: namespace %q, want the release's %q (or default, for the Events Role)", o.at, meta.Namespace, ns)
		}
		if strings.Contains(string(o.data), releaseNamespace) {
			t.Errorf("%s: names %s, not the release namespace %s", o.at, releaseNamespace, ns)
		}
	}

	// The config.
	c := r.config
	if want := (v1alpha1.InterfaceList{"eth0", "bond0"}); !slices.Equal(c.Interfaces, want) {
		t.Errorf("interfaces %v, want %v", c.Interfaces, want)
	}
	if c.XDPFallback != v1alpha1.XDPFallbackTC || c.EndpointHook != v1alpha1.EndpointHookPod || c.EndpointSourceCheck != v1alpha1.SourceCheckDrop {
		t.Errorf("xdpFallback %q, endpointHook %q, endpointSourceCheck %q", c.XDPFallback, c.EndpointHook, c.EndpointSourceCheck)
	}
	if c.MetricsAddress != "127.0.0.1:9500" || c.SecureMetrics.Address != ":9501" || c.SecureMetrics.CertDir != "/etc/rlagent-tls" {
		t.Errorf("metricsAddress %q, secureMetrics %+v", c.MetricsAddress, c.SecureMetrics)
	}
	if c.MaxBuckets != 131072 || !c.ManageQdisc || c.RejectBudget.Rate == nil || *c.RejectBudget.Rate != 100 {
		t.Errorf("maxBuckets %d, manageQdisc %v (extra), rejectBudget %+v (extra)", c.MaxBuckets, c.ManageQdisc, c.RejectBudget)
	}
	if d := c.DemandShares; d.Interval == nil || d.Interval.Duration != 30*time.Second || d.FloorPerMille == nil || *d.FloorPerMille != 5 {
		t.Errorf("demandShares %+v", d)
	}
	if len(c.Protect) != 1 || c.Protect[0].Name != "ssh" || !slices.Equal(c.Protect[0].LocalPorts, []string{"22", "2222-2223"}) ||
		!slices.Equal(c.Protect[0].Peers, []string{"10.0.0.0/8", "fd00::/8"}) {
		t.Errorf("protect %+v", c.Protect)
	}
	if len(c.Limits) != 0 {
		t.Errorf("limits in the ConfigMap")
	}

	// The DaemonSet.
	pod := r.daemonSet.Spec.Template.Spec
	ctr := pod.Containers[0]
	if want := "registry.example.com/team/rlagent@sha256:" + strings.Repeat("ab", 32); ctr.Image != want || ctr.ImagePullPolicy != corev1.PullAlways {
		t.Errorf("image %q (%s), want %q by digest (Always)", ctr.Image, ctr.ImagePullPolicy, want)
	}
	if !pod.HostPID || !slices.Contains(ctr.SecurityContext.Capabilities.Add, "SYS_ADMIN") {
		t.Errorf("endpointHook pod: hostPID %v, capabilities %v: want hostPID and SYS_ADMIN", pod.HostPID, ctr.SecurityContext.Capabilities.Add)
	}
	ports := map[string]int32{}
	for _, p := range ctr.Ports {
		ports[p.Name] = p.ContainerPort
	}
	if ports["metrics"] != 9500 || ports["https-metrics"] != 9501 {
		t.Errorf("container ports %v, want metrics 9500 and https-metrics 9501", ports)
	}
	if p := ctr.ReadinessProbe; p.PeriodSeconds != 2 || p.FailureThreshold != 1 || p.HTTPGet.Port.String() != "metrics" {
		t.Errorf("readiness probe %+v", p)
	}
	var certMounted bool
	for _, m := range ctr.VolumeMounts {
		for _, v := range pod.Volumes {
			certMounted = certMounted || (m.Name == v.Name && v.Secret != nil && v.Secret.SecretName == "rlagent-metrics-tls" &&
				m.MountPath == c.SecureMetrics.CertDir && m.ReadOnly)
		}
	}
	if !certMounted {
		t.Errorf("the Secret rlagent-metrics-tls is not mounted read-only at certDir %s", c.SecureMetrics.CertDir)
	}
	var hostIPs bool
	for _, e := range ctr.Env {
		hostIPs = hostIPs || (e.Name == "HOST_IPS" && e.ValueFrom != nil && e.ValueFrom.FieldRef.FieldPath == "status.hostIPs")
	}
	if !hostIPs {
		t.Error("no HOST_IPS from status.hostIPs (interfaces auto counts the node's addresses)")
	}
	if pod.PriorityClassName != "" || pod.NodeSelector["kubernetes.io/os"] != "linux" || pod.Affinity == nil || pod.Affinity.NodeAffinity == nil ||
		len(pod.Tolerations) != 1 || pod.Tolerations[0].Key != "dedicated" || r.daemonSet.Spec.Template.Annotations["example.com/owner"] != "network" {
		t.Errorf("scheduling: priorityClassName %q, nodeSelector %v, affinity %v, tolerations %v, annotations %v",
			pod.PriorityClassName, pod.NodeSelector, pod.Affinity, pod.Tolerations, r.daemonSet.Spec.Template.Annotations)
	}
	if u := r.daemonSet.Spec.UpdateStrategy.RollingUpdate; u == nil || u.MaxUnavailable.String() != "10%" {
		t.Errorf("updateStrategy %+v", r.daemonSet.Spec.UpdateStrategy)
	}
	if req, lim := ctr.Resources.Requests[corev1.ResourceCPU], ctr.Resources.Limits[corev1.ResourceMemory]; req.String() != "100m" || lim.String() != "256Mi" {
		t.Errorf("resources %+v", ctr.Resources)
	}

	// The policies name the agents of this namespace.
	for _, p := range r.policies {
		user := "request.userInfo.username == 'system:serviceaccount:" + ns + ":rlagent'"
		if !slices.ContainsFunc(p.Spec.MatchConditions, func(c admissionregistrationv1.MatchCondition) bool { return c.Expression == user }) {
			t.Errorf("policy %s: no match condition %s", p.Name, user)
		}
	}
	for _, b := range r.policyBindings {
		if b.Spec.ParamRef != nil && b.Spec.ParamRef.Namespace != ns {
			t.Errorf("binding %s: paramRef in %q, want %q", b.Name, b.Spec.ParamRef.Namespace, ns)
		}
	}

	// Secure metrics: the reader's ClusterRole, the Service and the
	// ServiceMonitor on the secure port.
	if cr := r.clusterRoles["rlagent-metrics-reader"]; cr == nil || len(cr.Rules) != 1 || !slices.Equal(cr.Rules[0].NonResourceURLs, []string{"/metrics"}) {
		t.Errorf("ClusterRole rlagent-metrics-reader %+v, want get on /metrics", cr)
	}
	if len(r.services) != 1 || len(r.serviceMonitors) != 1 {
		t.Fatalf("%d Services and %d ServiceMonitors, want 1 and 1", len(r.services), len(r.serviceMonitors))
	}
	svc, sm := r.services[0], r.serviceMonitors[0]
	if svc.Spec.ClusterIP != corev1.ClusterIPNone || len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != 9501 ||
		svc.Spec.Selector["app.kubernetes.io/component"] != "agent" {
		t.Errorf("Service %s: %+v, want headless on 9501 selecting the agents", svc.Name, svc.Spec)
	}
	for k, v := range r.daemonSet.Spec.Selector.MatchLabels {
		if svc.Spec.Selector[k] != v {
			t.Errorf("Service %s selects %v, not the DaemonSet's pods %v", svc.Name, svc.Spec.Selector, r.daemonSet.Spec.Selector.MatchLabels)
		}
	}
	if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != svc.Spec.Ports[0].Name || sm.Spec.Endpoints[0].Scheme == nil ||
		*sm.Spec.Endpoints[0].Scheme != "https" || sm.Labels["release"] != "prometheus" || sm.Spec.Endpoints[0].Interval != "30s" {
		t.Errorf("ServiceMonitor %+v", sm)
	}
	if tc := sm.Spec.Endpoints[0].TLSConfig; tc == nil || tc.ServerName == nil || *tc.ServerName != "rlagent-metrics.net-limits.svc" ||
		(tc.InsecureSkipVerify != nil && *tc.InsecureSkipVerify) {
		t.Errorf("ServiceMonitor tlsConfig %+v, want the values' (verified)", tc)
	}
	for k, v := range sm.Spec.Selector.MatchLabels {
		if svc.Labels[k] != v {
			t.Errorf("ServiceMonitor selects %v, not the Service's labels %v", sm.Spec.Selector.MatchLabels, svc.Labels)
		}
	}
}

// TestRenderInterfacesAuto: the default interfaces, auto, and a list of
// one, as the agent's parser reads them; secure metrics without a
// certificate Secret makes no mount.
func TestRenderInterfacesAuto(t *testing.T) {
	r := render(t, map[string]any{"metrics": map[string]any{"secure": map[string]any{"enabled": true}}}, releaseNamespace)
	if r.config == nil {
		t.Fatal("no config")
	}
	if !r.config.Interfaces.Auto() || r.config.SecureMetrics.Address != ":9479" || r.config.SecureMetrics.CertDir != "" {
		t.Errorf("interfaces %v, secureMetrics %+v: want auto, :9479 without certDir", r.config.Interfaces, r.config.SecureMetrics)
	}
	if n := len(r.daemonSet.Spec.Template.Spec.Volumes); n != 2 {
		t.Errorf("%d volumes, want the pins and the config only", n)
	}
	if len(r.services) != 0 || len(r.serviceMonitors) != 0 {
		t.Error("a Service or ServiceMonitor without metrics.serviceMonitor.enabled")
	}
	r = render(t, map[string]any{"config": map[string]any{"interfaces": []any{"eth0"}, "protect": []any{}}}, releaseNamespace)
	if r.config == nil || !slices.Equal(r.config.Interfaces, v1alpha1.InterfaceList{"eth0"}) || len(r.config.Protect) != 0 || r.config.Protect == nil {
		t.Errorf("interfaces [eth0], protect []: got %+v", r.config)
	}
}

// TestWrongValues: values.schema.json (or the chart's checks of what a
// schema cannot say) refuses each, and the error names the field.
func TestWrongValues(t *testing.T) {
	for _, c := range []struct {
		name string
		vals string
		want []string // in the error
	}{
		{"interfaces a number", "config: {interfaces: 7}", []string{"/config/interfaces"}},
		{"interfaces another string", "config: {interfaces: eth0}", []string{"/config/interfaces"}},
		{"interfaces empty", "config: {interfaces: []}", []string{"/config/interfaces"}},
		{"interfaces twice", "config: {interfaces: [eth0, eth0]}", []string{"/config/interfaces"}},
		{"xdpFallback", "config: {xdpFallback: bogus}", []string{"/config/xdpFallback", "'none', 'tc'"}},
		{"endpointHook", "config: {endpointHook: netns}", []string{"/config/endpointHook"}},
		{"a misspelled key", "config: {xdpFallbak: tc}", []string{"xdpFallbak"}},
		{"digest", "image: {digest: latest}", []string{"/image/digest"}},
		{"pullPolicy", "image: {pullPolicy: Sometimes}", []string{"/image/pullPolicy"}},
		{"maxBuckets", "config: {maxBuckets: 10}", []string{"/config/maxBuckets"}},
		{"metrics.port", "metrics: {port: 70000}", []string{"/metrics/port"}},
		{"protect rule", "config: {protect: [{name: ssh, port: 22}]}", []string{"/config/protect/0", "port"}},
		{"demandShares", "config: {demandShares: {floorPerMille: 50}}", []string{"/config/demandShares/floorPerMille"}},
		{"same ports", "metrics: {secure: {enabled: true, port: 9478}}", []string{"metrics.secure.port"}},
		{"serviceMonitor alone", "metrics: {serviceMonitor: {enabled: true}}", []string{"metrics.serviceMonitor.enabled", "metrics.secure.enabled"}},
		{"extra pinDir", "config: {extra: {pinDir: /x}}", []string{"config.extra.pinDir"}},
		{"extra interfaces", "config: {extra: {interfaces: [eth1]}}", []string{"config.extra.interfaces", "config.interfaces"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var vals map[string]any
			if err := yaml.Unmarshal([]byte(c.vals), &vals); err != nil {
				t.Fatal(err)
			}
			_, err := renderChart(chart, vals, releaseName, releaseNamespace)
			if err == nil {
				t.Fatalf("%s: rendered, want an error", c.vals)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%s: error does not name %q:\n%v", c.vals, w, err)
				}
			}
			t.Logf("%s: %v", c.vals, err)
		})
	}
}

// TestDeployIsRendering: deploy/*.yaml and the chart's crds/ are what
// render writes (make generate), so that neither is edited by hand.
// make verify-generate checks the same with git.
func TestDeployIsRendering(t *testing.T) {
	files, err := renderChart(chart, deployValues(), releaseName, releaseNamespace)
	if err != nil {
		t.Fatal(err)
	}
	want, err := deployManifests(files)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range deployFiles {
		got, err := os.ReadFile(filepath.Join(repo, "deploy", name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want[name]) {
			t.Errorf("deploy/%s is not the chart's rendering: run make generate (or go -C hack/helm run . render)", name)
		}
	}
	crd, err := os.ReadFile(filepath.Join(repo, crdSource))
	if err != nil {
		t.Fatal(err)
	}
	cp, err := os.ReadFile(filepath.Join(repo, crdCopy))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasSuffix(cp, crd) {
		t.Errorf("%s is not a copy of %s: run make generate", crdCopy, crdSource)
	}
	var x apiextensionsv1.CustomResourceDefinition
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(cp)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(bytes.TrimSpace(doc)) == 0 || !bytes.Contains(doc, []byte("kind:")) {
			continue
		}
		if err := yaml.UnmarshalStrict(doc, &x); err != nil {
			t.Errorf("%s: %v", crdCopy, err)
		}
	}
	if x.Name != "ratelimits."+v1alpha1.GroupName {
		t.Errorf("%s: CRD %q", crdCopy, x.Name)
	}
	// The default rendering decodes too (its meaning is deploy_test.go's).
	def := decodeAll(t, objects(t, files))
	if len(def.namespaces) != 1 || def.namespaces[0].Labels["pod-security.kubernetes.io/enforce"] != "privileged" {
		t.Errorf("deploy/'s rendering has no Namespace with the privileged Pod Security level")
	}
}
