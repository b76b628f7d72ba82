package v1alpha1

import (
	"reflect"
	"slices"
	"strconv"
	"testing"

	monv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// serviceAccountToken is where a pod (Prometheus) finds its own
// ServiceAccount token.
const serviceAccountToken = "/var/run/secrets/kubernetes.io/serviceaccount/token"

// TestMonitoring checks deploy/monitoring/ against the agents' deployment:
// each manifest decodes strictly into its type (prometheus-operator's for
// the monitors: a misspelled field is an error, not a scrape setting
// silently dropped); the headless Service selects the DaemonSet's pods and
// targets secureMetrics' port; the ServiceMonitor selects that Service and
// scrapes its port, by name, at https://.../metrics with Prometheus's
// ServiceAccount token; the PodMonitor selects the same pods in the agents'
// namespace, on the same port, with a ServiceAccount token Secret of its
// own namespace; and the ClusterRole grants get on /metrics and nothing
// else. That the agent answers such a scrape is test/k8s's
// TestSecureMetrics.
func TestMonitoring(t *testing.T) {
	d := readDeployment(t)
	if len(d.daemonSets) != 1 {
		t.Fatalf("want one DaemonSet in deploy/, got %d", len(d.daemonSets))
	}
	ds := d.daemonSets[0]
	pods := labels.Set(ds.Spec.Template.Labels)

	var (
		svcs    []*corev1.Service
		sms     []*monv1.ServiceMonitor
		pms     []*monv1.PodMonitor
		secrets []*corev1.Secret
		readers []*rbacv1.ClusterRole
	)
	for _, m := range d.monitoring {
		switch m.gvk {
		case corev1.SchemeGroupVersion.WithKind("Service"):
			if x := new(corev1.Service); decode(t, m, x) {
				svcs = append(svcs, x)
			}
		case corev1.SchemeGroupVersion.WithKind("Secret"):
			if x := new(corev1.Secret); decode(t, m, x) {
				secrets = append(secrets, x)
			}
		case monv1.SchemeGroupVersion.WithKind(monv1.ServiceMonitorsKind):
			if x := new(monv1.ServiceMonitor); decode(t, m, x) {
				sms = append(sms, x)
			}
		case monv1.SchemeGroupVersion.WithKind(monv1.PodMonitorsKind):
			if x := new(monv1.PodMonitor); decode(t, m, x) {
				pms = append(pms, x)
			}
		case rbacv1.SchemeGroupVersion.WithKind("ClusterRole"):
			if x := new(rbacv1.ClusterRole); decode(t, m, x) {
				readers = append(readers, x)
			}
		default:
			t.Errorf("%s: unexpected %v: add it to this test, with checks", m.at, m.gvk)
		}
	}
	if len(svcs) != 1 || len(sms) != 1 || len(pms) != 1 || len(secrets) != 1 || len(readers) != 1 {
		t.Fatalf("deploy/monitoring: want one Service, ServiceMonitor, PodMonitor, Secret and ClusterRole; got %d, %d, %d, %d, %d",
			len(svcs), len(sms), len(pms), len(secrets), len(readers))
	}

	// The reader: get on /metrics, the URL the agent's filter asks about.
	if r := readers[0]; r.Name != "rlagent-metrics-reader" ||
		!reflect.DeepEqual(r.Rules, []rbacv1.PolicyRule{{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}}}) {
		t.Errorf("ClusterRole %s: rules %+v; want rlagent-metrics-reader with get on /metrics only", r.Name, r.Rules)
	}

	// The Service: headless, the agents' pods, secureMetrics' port.
	svc := svcs[0]
	if svc.Namespace != agentNamespace || svc.Spec.ClusterIP != corev1.ClusterIPNone {
		t.Errorf("Service %s/%s: want a headless Service (clusterIP None) in %s", svc.Namespace, svc.Name, agentNamespace)
	}
	if len(svc.Spec.Selector) == 0 || !labels.SelectorFromSet(svc.Spec.Selector).Matches(pods) {
		t.Errorf("Service selector %v does not select the DaemonSet's pods %v", svc.Spec.Selector, pods)
	}
	if len(svc.Spec.Ports) != 1 {
		t.Fatalf("Service ports %+v: want one", svc.Spec.Ports)
	}
	port := svc.Spec.Ports[0]
	if port.Name == "" || port.TargetPort.IntValue() != SecureMetricsPort {
		t.Errorf("Service port %+v: want a named port with targetPort %d (secureMetrics.address)", port, SecureMetricsPort)
	}
	for _, c := range ds.Spec.Template.Spec.Containers {
		for _, p := range c.Ports {
			if p.ContainerPort == SecureMetricsPort || p.HostPort == SecureMetricsPort {
				t.Errorf("the DaemonSet's port %s is %d, secureMetrics' port", p.Name, SecureMetricsPort)
			}
		}
	}

	// The ServiceMonitor: that Service, its port by name.
	sm := sms[0]
	sel, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
	if err != nil {
		t.Fatalf("ServiceMonitor selector: %v", err)
	}
	if sm.Namespace != svc.Namespace || sel.Empty() || !sel.Matches(labels.Set(svc.Labels)) {
		t.Errorf("ServiceMonitor %s/%s (selector %v) does not select the Service %s/%s (labels %v)",
			sm.Namespace, sm.Name, sel, svc.Namespace, svc.Name, svc.Labels)
	}
	if len(sm.Spec.Endpoints) != 1 {
		t.Fatalf("ServiceMonitor endpoints %+v: want one", sm.Spec.Endpoints)
	}
	ep := sm.Spec.Endpoints[0]
	if ep.Port != port.Name || ep.Path != "/metrics" || ep.Scheme != "https" {
		t.Errorf("ServiceMonitor endpoint: port %q, path %q, scheme %q; want port %q, path /metrics, scheme https",
			ep.Port, ep.Path, ep.Scheme, port.Name)
	}
	if ep.BearerTokenFile != serviceAccountToken && ep.Authorization == nil { //nolint:staticcheck // the file is what a ServiceMonitor can name
		t.Errorf("ServiceMonitor endpoint: no token (bearerTokenFile %s, or authorization)", serviceAccountToken)
	}
	if ep.TLSConfig == nil || ep.TLSConfig.InsecureSkipVerify == nil || !*ep.TLSConfig.InsecureSkipVerify {
		t.Errorf("ServiceMonitor endpoint tlsConfig %+v: want insecureSkipVerify true (the agent's default certificate is self-signed)", ep.TLSConfig)
	}

	// The PodMonitor: the agents' pods in their namespace, the same port,
	// a token from a Secret beside it.
	pm := pms[0]
	if !slices.Equal(pm.Spec.NamespaceSelector.MatchNames, []string{agentNamespace}) || pm.Spec.NamespaceSelector.Any {
		t.Errorf("PodMonitor namespaceSelector %+v: want matchNames [%s]", pm.Spec.NamespaceSelector, agentNamespace)
	}
	psel, err := metav1.LabelSelectorAsSelector(&pm.Spec.Selector)
	if err != nil {
		t.Fatalf("PodMonitor selector: %v", err)
	}
	if psel.Empty() || !psel.Matches(pods) {
		t.Errorf("PodMonitor selector %v does not select the DaemonSet's pods %v", psel, pods)
	}
	if len(pm.Spec.PodMetricsEndpoints) != 1 {
		t.Fatalf("PodMonitor endpoints %+v: want one", pm.Spec.PodMetricsEndpoints)
	}
	pep := pm.Spec.PodMetricsEndpoints[0]
	if pep.PortNumber == nil || *pep.PortNumber != SecureMetricsPort || pep.Port != nil || pep.Path != "/metrics" || pep.Scheme != "https" {
		t.Errorf("PodMonitor endpoint: portNumber %v, port %v, path %q, scheme %q; want portNumber %d, path /metrics, scheme https",
			pep.PortNumber, pep.Port, pep.Path, pep.Scheme, SecureMetricsPort)
	}
	sec := secrets[0]
	if a := pep.Authorization; a == nil || a.Credentials == nil || (a.Type != "" && a.Type != "Bearer") ||
		a.Credentials.Name != sec.Name || a.Credentials.Key != corev1.ServiceAccountTokenKey {
		t.Errorf("PodMonitor authorization %+v: want Bearer credentials from Secret %s, key %s", pep.Authorization, sec.Name, corev1.ServiceAccountTokenKey)
	}
	if sec.Type != corev1.SecretTypeServiceAccountToken || sec.Namespace != pm.Namespace || sec.Annotations[corev1.ServiceAccountNameKey] == "" {
		t.Errorf("Secret %s/%s: type %s, annotations %v; want a ServiceAccount token Secret in the PodMonitor's namespace %s",
			sec.Namespace, sec.Name, sec.Type, sec.Annotations, pm.Namespace)
	}
	if pep.TLSConfig == nil || pep.TLSConfig.InsecureSkipVerify == nil || !*pep.TLSConfig.InsecureSkipVerify {
		t.Errorf("PodMonitor endpoint tlsConfig %+v: want insecureSkipVerify true (the agent's default certificate is self-signed)", pep.TLSConfig)
	}
	t.Logf("Service %s port %s -> %s; PodMonitor port %d", svc.Name, port.Name, strconv.Itoa(port.TargetPort.IntValue()), *pep.PortNumber)
}
