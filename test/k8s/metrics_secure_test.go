package k8s

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/rlagent/rlagent/internal/agenttest"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/nettest"
)

// TestSecureMetrics: an agent of the binary under test, in a cluster
// (--kubeconfig) with secureMetrics on, serves /metrics over TLS only to
// the clients the real API server vouches for, scraped as Prometheus does
// (a bearer token, the certificate not verified):
//   - no token: 401;
//   - a ServiceAccount's token (TokenRequest) without RBAC: 403;
//   - the same token once deploy/monitoring's ClusterRole
//     rlagent-metrics-reader is bound to the ServiceAccount: 200, with the
//     agent's rlagent_ metrics (within the agent's 30 s cache of the
//     denial);
//   - a token the API server never issued: 401;
//   - another path with the good token: 404 (only /metrics is there).
//
// The plain listener answers /readyz (and /metrics) without a token, as
// the kubelet's probes ask.
func TestSecureMetrics(t *testing.T) {
	env := k8stest.Shared(t)
	installCRD(t, env)
	ns := env.Namespace(t)
	ctx := t.Context()
	admin := env.Clientset()

	// One node: the agent in B, with both listeners on B's loopback.
	pair := nettest.MustPair(t, nettest.PairConfig{
		NameA: "sm-client", NameB: "sm-node", IfA: "veth-client", IfB: "veth-node",
		Subnet4: netip.MustParsePrefix("10.203.1.0/24"),
		Subnet6: netip.MustParsePrefix("fd00:203:1::/64"),
	})
	dir := t.TempDir()
	pins := agenttest.PinDir(t, rlagentBin, filepath.Join(dir, "bpf"))
	const plainAddr, secureAddr = "127.0.0.1:9478", "127.0.0.1:9479"
	config := filepath.Join(dir, "rlagent.yaml")
	yml := fmt.Sprintf("interfaces: [%s]\npinDir: %s\nmetricsAddress: %q\nsecureMetrics:\n  address: %q\n",
		pair.IfB, pins.Dir, plainAddr, secureAddr)
	if err := os.WriteFile(config, []byte(yml), 0o644); err != nil {
		t.Fatal(err)
	}
	forwardTCP(t, pair.B, apiServerAddr(t, env))
	agent := agenttest.StartAgent(t, pair.B, rlagentBin,
		"--config", config, "--kubeconfig", env.Kubeconfig,
		"--node-name", "sm-node", "--agent-namespace", ns, "--agent-daemonset", agentDaemonSet,
		"--pod-name", "rlagent-sm-node", "--log-level", "debug")
	agent.WaitAttached(agenttest.AttachTimeout)

	// A client in B's network namespace, which skips verifying the
	// self-signed certificate as deploy/monitoring's monitors do.
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			var c net.Conn
			err := pair.B.Do(func() error {
				var err error
				c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
				return err
			})
			return c, err
		},
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true},
	}}
	get := func(url, token string) (int, string) {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			t.Fatal(err)
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("GET %s: %v\nagent:\n%s", url, err, agent.Log())
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("GET %s: %v", url, err)
		}
		if strings.HasPrefix(url, "https:") && (resp.TLS == nil || len(resp.TLS.PeerCertificates) == 0 || resp.TLS.NegotiatedProtocol == "h2") {
			t.Errorf("GET %s: TLS %+v; want TLS with a certificate, HTTP/1.1", url, resp.TLS)
		}
		return resp.StatusCode, string(body)
	}
	metrics := "https://" + secureAddr + "/metrics"

	// A ServiceAccount, as Prometheus's, with a token from the API server.
	const sa = "prometheus"
	if _, err := admin.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	expiry := int64(3600)
	tr, err := admin.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &expiry},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("TokenRequest: %v", err)
	}
	token := tr.Status.Token
	user := "system:serviceaccount:" + ns + ":" + sa

	if code, body := get(metrics, ""); code != http.StatusUnauthorized {
		t.Errorf("no token: %d %q, want 401", code, body)
	}
	if code, body := get(metrics, token); code != http.StatusForbidden {
		t.Errorf("%s without RBAC: %d %q, want 403", user, code, body)
	}
	garbage := "eyJhbGciOiJSUzI1NiJ9.not-a-token.at-all"
	if code, body := get(metrics, garbage); code != http.StatusUnauthorized {
		t.Errorf("a token the API server never issued: %d %q, want 401", code, body)
	}

	// deploy/monitoring's ClusterRole, bound to the ServiceAccount.
	var reader *rbacv1.ClusterRole
	for _, obj := range readManifests(t, filepath.Join(deployDir, "monitoring", "metrics-reader.yaml")) {
		if obj.GetKind() == "ClusterRole" {
			reader = new(rbacv1.ClusterRole)
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, reader); err != nil {
				t.Fatal(err)
			}
		}
	}
	if reader == nil || reader.Name != "rlagent-metrics-reader" {
		t.Fatalf("deploy/monitoring/metrics-reader.yaml: no ClusterRole rlagent-metrics-reader")
	}
	crs, crbs := admin.RbacV1().ClusterRoles(), admin.RbacV1().ClusterRoleBindings()
	if _, err := crs.Create(ctx, reader, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { crs.Delete(context.Background(), reader.Name, metav1.DeleteOptions{}) })
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: reader.Name + "-" + ns},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: reader.Name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: sa, Namespace: ns}},
	}
	if _, err := crbs.Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { crbs.Delete(context.Background(), binding.Name, metav1.DeleteOptions{}) })
	// The API server's authorizer counts a new binding a moment later.
	k8stest.WaitUntil(t, "the binding in force", func() bool {
		sar, err := admin.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
			Spec: authorizationv1.SubjectAccessReviewSpec{User: user,
				Groups:                []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
				NonResourceAttributes: &authorizationv1.NonResourceAttributes{Path: "/metrics", Verb: "get"}},
		}, metav1.CreateOptions{})
		return err == nil && sar.Status.Allowed
	})
	// The agent cached the denial (30 s, deniedTTL).
	start := time.Now()
	var code int
	var body string
	waitFor(t, 60*time.Second, "the scrape allowed", func() (bool, string) {
		code, body = get(metrics, token)
		return code == http.StatusOK, fmt.Sprintf("%d %.200q", code, body)
	})
	t.Logf("allowed %v after the binding counted (the agent's cache of the denial)", time.Since(start).Round(time.Second))
	for _, want := range []string{"\nrlagent_ready 1\n", "\nrlagent_interface_attached{", "# TYPE rlagent_reconcile_errors_total counter"} {
		if !strings.Contains(body, want) {
			t.Errorf("the scrape has no %q:\n%.3000s", want, body)
		}
	}
	if code, body := get("https://"+secureAddr+"/readyz", token); code != http.StatusNotFound {
		t.Errorf("/readyz on the secure listener: %d %q, want 404 (the probes are on the plain one)", code, body)
	}
	if code, body := get(metrics, garbage); code != http.StatusUnauthorized {
		t.Errorf("a token the API server never issued, after the binding: %d %q, want 401", code, body)
	}

	// The plain listener: no TLS, no token.
	if code, body := get("http://"+plainAddr+"/readyz", ""); code != http.StatusOK {
		t.Errorf("plain /readyz: %d %q, want 200", code, body)
	}
	if code, body := get("http://"+plainAddr+"/metrics", ""); code != http.StatusOK || !strings.Contains(body, "rlagent_ready") {
		t.Errorf("plain /metrics: %d %.300q, want 200 with rlagent_ready", code, body)
	}
}
