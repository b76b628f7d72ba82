package k8s

import (
	"bytes"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/agenttest"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/testenv"
)

// TestSchemaRejectsInvalid: the API server rejects invalid RateLimits with
// deploy/crd.yaml's schema, with a message that names the field and says
// what is wrong, and stores nothing; `rlagent limits set --kubeconfig`
// shows the API server's error as it is.
func TestSchemaRejectsInvalid(t *testing.T) {
	env := k8stest.Shared(t)
	installCRD(t, env)
	rl := dynamicClient(t, env).Resource(v1alpha1.RateLimitResource)
	udp := map[string]any{"protocol": "udp"}
	withPorts := func(ports ...any) map[string]any { return map[string]any{"protocol": "udp", "dstPorts": ports} }
	cases := []struct {
		name string
		spec map[string]any
		want []string // substrings of the error message
	}{
		{"rate-zero", map[string]any{"rate": 0, "scope": "nodes", "match": udp},
			[]string{"spec.rate: Invalid value: 0", "should be greater than or equal to 1"}},
		{"rate-missing", map[string]any{"scope": "nodes", "match": udp},
			[]string{"spec.rate: Required value"}},
		{"scope-missing", map[string]any{"rate": 10, "match": udp},
			[]string{"spec.scope: Required value"}},
		{"scope-unknown", map[string]any{"rate": 10, "scope": "cluster", "match": udp},
			[]string{`spec.scope: Unsupported value: "cluster"`, `supported values: "static", "nodes", "service"`}},
		{"key-unknown", map[string]any{"rate": 10, "scope": "nodes", "key": "src-port", "match": udp},
			[]string{`spec.key: Unsupported value: "src-port"`, `"none", "src-ip", "dst-ip", "src-prefix", "dst-prefix", "dst-port"`}},
		{"port-pattern", map[string]any{"rate": 10, "scope": "nodes", "match": withPorts("80-")},
			[]string{`spec.match.dstPorts[0]: Invalid value: "80-"`, "should match '^[0-9]{1,5}(-[0-9]{1,5})?$'"}},
		{"port-range", map[string]any{"rate": 10, "scope": "nodes", "match": withPorts("53", "70000")},
			[]string{"spec.match.dstPorts[1]", "ports are 0..65535"}},
		{"port-reversed", map[string]any{"rate": 10, "scope": "nodes", "match": withPorts("8080-8000")},
			[]string{"spec.match.dstPorts[0]", "the first port of a range must not be above the last"}},
		{"cidr", map[string]any{"rate": 10, "scope": "nodes", "match": map[string]any{"srcCIDRs": []any{"10.0.0.0/33"}}},
			[]string{"spec.match.srcCIDRs[0]", "must be an IPv4 or IPv6 network or address"}},
		{"service-missing", map[string]any{"rate": 10, "scope": "service", "match": udp},
			[]string{"spec.match.service: Required value", "scope service requires match.service"}},
		{"service-without-scope", map[string]any{"rate": 10, "scope": "nodes", "match": map[string]any{"service": "shop/checkout"}},
			[]string{"spec.match.service", "match.service is only allowed with scope service"}},
		{"service-format", map[string]any{"rate": 10, "scope": "service", "match": map[string]any{"service": "checkout"}},
			[]string{`spec.match.service: Invalid value: "checkout"`, "should match"}},
		{"pace-ingress", map[string]any{"rate": 10, "scope": "nodes", "action": "pace", "match": udp},
			[]string{"spec.action", "action pace needs match.direction egress"}},
		{"pace-at-endpoints", map[string]any{"rate": 10, "scope": "service", "action": "pace",
			"match": map[string]any{"direction": "egress", "service": "shop/checkout"}},
			[]string{"spec.attach", "action pace needs attach uplink"}},
		{"horizon-without-pace", map[string]any{"rate": 10, "scope": "nodes", "horizon": "100ms", "match": udp},
			[]string{"spec.horizon", "horizon is only allowed with action pace"}},
		{"horizon-not-a-duration", map[string]any{"rate": 10, "scope": "nodes", "action": "pace", "horizon": "soon",
			"match": map[string]any{"direction": "egress"}},
			[]string{"spec.horizon"}},
		{"reject-egress", map[string]any{"rate": 10, "scope": "nodes", "action": "reject", "match": map[string]any{"direction": "egress"}},
			[]string{"spec.action", "action reject needs match.direction ingress"}},
		{"share-unknown", map[string]any{"rate": 10, "scope": "nodes", "share": "fair", "match": udp},
			[]string{`spec.share: Unsupported value: "fair"`, `"equal", "demand"`}},
		{"share-demand-static", map[string]any{"rate": 10, "scope": "static", "share": "demand", "match": udp},
			[]string{"spec.share", "share demand needs scope nodes, service or pods"}},
		{"share-demand-keyed-pace", map[string]any{"rate": 10, "scope": "nodes", "share": "demand", "action": "pace", "key": "dst-ip",
			"match": map[string]any{"direction": "egress"}},
			[]string{"spec.share", "share demand with a key cannot pace"}},
		{"hot-keys-share-equal", map[string]any{"rate": 10, "scope": "nodes", "key": "src-ip", "hotKeys": 16, "match": udp},
			[]string{"spec.hotKeys", "hotKeys is only allowed with share demand and a key"}},
		{"hot-keys-without-key", map[string]any{"rate": 10, "scope": "nodes", "share": "demand", "hotKeys": 16, "match": udp},
			[]string{"spec.hotKeys", "hotKeys is only allowed with share demand and a key"}},
		{"hot-keys-zero", map[string]any{"rate": 10, "scope": "nodes", "share": "demand", "key": "src-ip", "hotKeys": 0, "match": udp},
			[]string{"spec.hotKeys: Invalid value: 0", "should be greater than or equal to 1"}},
		{"hot-keys-too-many", map[string]any{"rate": 10, "scope": "nodes", "share": "demand", "key": "src-ip", "hotKeys": 257, "match": udp},
			[]string{"spec.hotKeys: Invalid value: 257", "should be less than or equal to 256"}},
		// unit requests: the limiter library's (TestValidateRequests).
		{"on-empty-packets", map[string]any{"rate": 10, "scope": "nodes", "onEmpty": "wait", "match": udp},
			[]string{"spec.onEmpty", "onEmpty is only allowed with unit requests"}},
		{"max-wait-fail", map[string]any{"rate": 10, "unit": "requests", "scope": "static", "onEmpty": "fail", "maxWait": "1s", "match": map[string]any{}},
			[]string{"spec.maxWait", "maxWait is only allowed with onEmpty wait"}},
		{"key-custom-packets", map[string]any{"rate": 10, "scope": "nodes", "key": "custom", "match": udp},
			[]string{"spec.key", "key custom is only allowed with unit requests"}},
		{"requests-nodes", map[string]any{"rate": 10, "unit": "requests", "scope": "nodes", "match": map[string]any{}},
			[]string{"spec.scope", "unit requests is enforced in the Service's own processes"}},
		{"requests-dst-ip", map[string]any{"rate": 10, "unit": "requests", "scope": "static", "key": "dst-ip", "match": map[string]any{}},
			[]string{"spec.key", "unit requests allows key none, src-ip, src-prefix"}},
		{"requests-reject", map[string]any{"rate": 10, "unit": "requests", "scope": "static", "action": "reject", "match": map[string]any{}},
			[]string{"spec.action", "unit requests allows action drop or shadow"}},
		{"requests-attach", map[string]any{"rate": 10, "unit": "requests", "scope": "static", "attach": "uplink", "match": map[string]any{}},
			[]string{"spec.attach", "attach is not allowed with unit requests"}},
		{"requests-ports", map[string]any{"rate": 10, "unit": "requests", "scope": "static", "match": withPorts("443")},
			[]string{"spec.match", "unit requests matches every request"}},
		{"requests-demand", map[string]any{"rate": 10, "unit": "requests", "scope": "service", "share": "demand",
			"match": map[string]any{"service": "shop/api"}},
			[]string{"spec.share", "unit requests allows share equal only"}},
		{"burst-zero", map[string]any{"rate": 10, "burst": 0, "scope": "nodes", "match": udp},
			[]string{"spec.burst: Invalid value: 0", "should be greater than or equal to 1"}},
		{"name.with.dots", map[string]any{"rate": 10, "scope": "nodes", "match": udp},
			[]string{"metadata.name is the limit's name"}},
	}
	for _, tc := range cases {
		_, err := rl.Create(t.Context(), rateLimit(tc.name, tc.spec), metav1.CreateOptions{})
		if err == nil {
			deleteInCleanup(t, env, tc.name)
			t.Errorf("%s: the API server accepted %v", tc.name, tc.spec)
			continue
		}
		t.Logf("%s: %v", tc.name, err)
		if !apierrors.IsInvalid(err) {
			t.Errorf("%s: %v: want a 422 Invalid", tc.name, err)
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: the message does not say %q: %v", tc.name, w, err)
			}
		}
		if _, err := rl.Get(t.Context(), tc.name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("%s: get after the rejected create: %v, want NotFound", tc.name, err)
		}
	}

	// The CLI prints the API server's error unchanged: the same text a
	// client-go create of the object it sends gets back.
	for _, args := range [][]string{
		{"limits", "set", "cli-bad-rate", "--rate", "0", "--scope", "nodes", "--protocol", "udp"},
		{"limits", "set", "cli-no-service", "--rate", "100", "--scope", "service", "--protocol", "udp"},
		{"limits", "set", "cli-bad-port", "--rate", "100", "--scope", "nodes", "--protocol", "udp", "--dst-ports", "99999"},
	} {
		name := args[2]
		deleteInCleanup(t, env, name) // should it get created after all
		cmd := exec.Command(rlagentBin, append(args, "--kubeconfig", env.Kubeconfig)...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		if err == nil {
			t.Errorf("rlagent %s: succeeded, want the API server's rejection; output:\n%s", strings.Join(args, " "), stdout.String())
			continue
		}
		// What the API server says of the same object.
		want := dryRunError(t, env, name, args)
		got := strings.TrimSpace(stderr.String())
		t.Logf("rlagent %s: %s", strings.Join(args[:3], " "), got)
		if got != "rlagent: "+want {
			t.Errorf("rlagent %s prints\n  %s\nwant the API server's error as it is:\n  rlagent: %s", strings.Join(args, " "), got, want)
		}
	}
}

// dryRunError creates, as a server-side dry run, the RateLimit that
// `rlagent limits set` args would send, and returns the API server's error
// message.
func dryRunError(t *testing.T, env *k8stest.Env, name string, args []string) string {
	t.Helper()
	spec := map[string]any{
		"unit": "packets", "key": "none", "action": "drop",
		"match": map[string]any{"direction": "ingress", "protocol": "any"},
	}
	match := spec["match"].(map[string]any)
	for i := 3; i+1 < len(args); i += 2 {
		switch v := args[i+1]; args[i] {
		case "--rate":
			var n int64
			fmt.Sscan(v, &n)
			spec["rate"] = n
		case "--scope":
			spec["scope"] = v
		case "--protocol":
			match["protocol"] = v
		case "--dst-ports":
			match["dstPorts"] = []any{v}
		default:
			t.Fatalf("dryRunError: flag %s not handled", args[i])
		}
	}
	rl := dynamicClient(t, env).Resource(v1alpha1.RateLimitResource)
	_, err := rl.Create(t.Context(), rateLimit(name, spec), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	if err == nil {
		t.Fatalf("the API server accepts %v, which the test expects it to reject", spec)
	}
	return err.Error()
}

// TestAgentValidationAndDelete: a RateLimit that passes the schema but not
// the agents' own validation (a horizon beyond the data path's bounds, which
// the schema does not check) gets the condition Accepted=False with the
// agents' message, and no agent enforces it; a valid one gets Accepted=True and the count in
// status.replicas. Deleting a RateLimit removes its map entries from every
// agent, and only its own.
func TestAgentValidationAndDelete(t *testing.T) {
	testenv.RequireRoot(t)
	env := k8stest.Shared(t)
	installCRD(t, env)
	c := startCluster(t, env, env.Namespace(t), 3)
	c.createService()
	l := layout{ready: []int{1, 1, 1}}
	c.setEndpoints(l)
	rl := dynamicClient(t, env).Resource(v1alpha1.RateLimitResource)

	// Two valid limits; the first is deleted below, the second stays.
	for _, name := range []string{"valid-deleted", "valid-kept"} {
		created := time.Now()
		createRateLimit(t, env, rateLimit(name, c.serviceSpec(globalRate)))
		a, err := c.waitShares(name, c.serviceWants(globalRate, l), created, 10*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		t.Logf("%s created: %v", name, a)
	}
	waitStatus := func(name, status, msg string, replicas int64) *unstructured.Unstructured {
		t.Helper()
		var obj *unstructured.Unstructured
		took := waitFor(t, 15*time.Second, fmt.Sprintf("RateLimit %s: Accepted=%s, replicas %d", name, status, replicas), func() (bool, string) {
			var err error
			obj, err = rl.Get(t.Context(), name, metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			got, _, _ := unstructured.NestedInt64(obj.Object, "status", "replicas")
			c := condition(obj, v1alpha1.ConditionAccepted)
			if c == nil || c["status"] != status || !strings.Contains(fmt.Sprint(c["message"]), msg) || got != replicas {
				return false, fmt.Sprintf("status %v", obj.Object["status"])
			}
			return true, ""
		})
		cond := condition(obj, v1alpha1.ConditionAccepted)
		t.Logf("%s: Accepted=%s (reason %v, message %q), replicas %d, %s after the wait began", name, cond["status"], cond["reason"], cond["message"], replicas, ms(took))
		if gen, _, _ := unstructured.NestedInt64(obj.Object, "status", "observedGeneration"); gen != obj.GetGeneration() {
			t.Errorf("%s: status.observedGeneration %d, want the generation %d", name, gen, obj.GetGeneration())
		}
		return obj
	}
	waitStatus("valid-kept", "True", "", 3)

	// Past the schema, rejected by the agents.
	for _, tc := range []struct {
		name  string
		patch func(map[string]any)
		msg   string
	}{
		{"pace-horizon-10s", func(s map[string]any) {
			s["action"] = "pace"
			s["attach"] = "uplink"
			s["horizon"] = "10s"
			s["match"].(map[string]any)["direction"] = "egress"
		}, `spec.horizon: 10s is not in 1ms..4s`},
	} {
		spec := c.serviceSpec(globalRate)
		tc.patch(spec)
		createRateLimit(t, env, rateLimit(tc.name, spec))
		// The agents count the endpoints of a limit they reject, too.
		waitStatus(tc.name, "False", tc.msg, 3)
		for _, nd := range c.nodes {
			if s, ok := nd.limit(t, tc.name); ok {
				t.Errorf("%s: %s enforces the rejected limit: %s", tc.name, nd.name, describe(s, ok))
			}
		}
	}

	// The count in the status follows the endpoints.
	six := layout{ready: []int{3, 2, 1}}
	started, _ := c.setEndpoints(six)
	if _, err := c.waitShares("valid-kept", c.serviceWants(globalRate, six), started, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	waitStatus("valid-kept", "True", "", 6)

	deleted := time.Now()
	if err := rl.Delete(t.Context(), "valid-deleted", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	absent := []want{{absent: true}, {absent: true}, {absent: true}}
	a, err := c.waitShares("valid-deleted", absent, deleted, 5*time.Second)
	if err != nil {
		t.Fatalf("after the delete: %v", err)
	}
	t.Logf("valid-deleted deleted: %v", a)
	for i, nd := range c.nodes {
		st, _ := agenttest.Status[[]agent.LimitStatus](t, rlagentBin, nd.pins.Dir)
		var names []string
		for _, s := range st {
			names = append(names, s.Name)
		}
		if strings.Contains(strings.Join(names, ","), "valid-deleted") {
			t.Errorf("rlagent status on %s still lists valid-deleted: %v", nd.name, names)
		}
		if s, ok := nd.limit(t, "valid-kept"); !c.serviceWants(globalRate, six)[i].matches(s, ok) {
			t.Errorf("%s: valid-kept after deleting valid-deleted: %s, want %s", nd.name, describe(s, ok), c.serviceWants(globalRate, six)[i])
		}
	}
}
