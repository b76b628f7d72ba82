package v1alpha1

import (
	"encoding/json"
	"reflect"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
)

func TestScheme(t *testing.T) {
	s := runtime.NewScheme()
	if err := AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	for kind, obj := range map[string]runtime.Object{"RateLimit": &RateLimit{}, "RateLimitList": &RateLimitList{}} {
		gvks, _, err := s.ObjectKinds(obj)
		if err != nil {
			t.Fatalf("%s: %v", kind, err)
		}
		if want := SchemeGroupVersion.WithKind(kind); len(gvks) != 1 || gvks[0] != want {
			t.Errorf("%s registered as %v, want %v", kind, gvks, want)
		}
	}
	if got := Resource("ratelimits").String(); got != "ratelimits.rlagent.io" {
		t.Errorf("Resource: %s", got)
	}
	if got := Kind("RateLimit").String(); got != "RateLimit.rlagent.io" {
		t.Errorf("Kind: %s", got)
	}
	if RateLimitResource.GroupResource() != Resource("ratelimits") || RateLimitResource.Version != Version {
		t.Errorf("RateLimitResource: %v", RateLimitResource)
	}

	// A RateLimit as the API server sends it decodes into the typed object.
	data := []byte(`{"apiVersion":"rlagent.io/v1alpha1","kind":"RateLimit",
		"metadata":{"name":"dns","generation":2},
		"spec":{"rate":20000,"match":{"protocol":"udp","dstPorts":["53"]},"scope":"nodes"},
		"status":{"observedGeneration":2,"replicas":3,"conditions":[{"type":"Accepted","status":"True",
			"reason":"Valid","message":"","lastTransitionTime":"2025-01-01T00:00:00Z"}]}}`)
	obj, gvk, err := serializer.NewCodecFactory(s).UniversalDeserializer().Decode(data, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	rl, ok := obj.(*RateLimit)
	if !ok {
		t.Fatalf("decoded a %T (%v)", obj, gvk)
	}
	want := RateLimitSpec{Rate: 20000, Match: Match{Protocol: ProtocolUDP, DstPorts: []string{"53"}}, Scope: ScopeNodes}
	if rl.Name != "dns" || !reflect.DeepEqual(rl.Spec, want) || rl.Status.Replicas != 3 ||
		len(rl.Status.Conditions) != 1 || rl.Status.Conditions[0].Type != ConditionAccepted {
		t.Errorf("decoded %+v", rl)
	}
}

// TestDeepCopy checks that a copy shares no memory with the original: every
// pointer, slice and map the spec and status hold is copied.
func TestDeepCopy(t *testing.T) {
	orig := &RateLimit{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Labels: map[string]string{"team": "a"}},
		Spec: RateLimitSpec{
			Rate: 100, Burst: ptr(uint64(500)),
			Match: Match{
				DstPorts: []string{"80"}, SrcCIDRs: []string{"10.0.0.0/8"}, DstCIDRs: []string{"192.0.2.1"},
			},
			Key: KeySrcPrefix, PrefixLength: &PrefixLength{IPv4: 24, IPv6: 64}, Scope: ScopeNodes,
		},
		Status: RateLimitStatus{Replicas: 3, Conditions: []metav1.Condition{{Type: ConditionAccepted, Status: metav1.ConditionTrue}}},
	}
	before, err := json.Marshal(orig)
	if err != nil {
		t.Fatal(err)
	}
	cp := orig.DeepCopyObject().(*RateLimit)
	if !reflect.DeepEqual(cp, orig) {
		t.Fatalf("copy differs:\n%+v\n%+v", cp, orig)
	}
	*cp.Spec.Burst = 1
	cp.Spec.Match.DstPorts[0] = "81"
	cp.Spec.Match.SrcCIDRs[0] = "10.0.0.0/9"
	cp.Spec.Match.DstCIDRs[0] = "192.0.2.2"
	cp.Spec.PrefixLength.IPv4 = 8
	cp.Status.Conditions[0].Status = metav1.ConditionFalse
	cp.Labels["team"] = "b"
	after, _ := json.Marshal(orig)
	if string(before) != string(after) {
		t.Errorf("changing the copy changed the original:\n%s\n%s", before, after)
	}

	list := &RateLimitList{Items: []RateLimit{*orig}}
	lcp := list.DeepCopyObject().(*RateLimitList)
	lcp.Items[0].Spec.Match.DstPorts[0] = "82"
	if orig.Spec.Match.DstPorts[0] != "80" {
		t.Error("changing a list's copy changed the original")
	}
}

// TestStatusJSON pins the status's JSON: an object whose status was never
// written has none, and a count of 0 is written as 0, not left out (0 ready
// endpoints is an observation).
func TestStatusJSON(t *testing.T) {
	for _, c := range []struct {
		rl   RateLimit
		want string
	}{
		{RateLimit{Spec: RateLimitSpec{Rate: 1, Scope: ScopeNodes}},
			`{"metadata":{},"spec":{"rate":1,"match":{},"scope":"nodes"}}`},
		{RateLimit{Spec: RateLimitSpec{Rate: 1, Scope: ScopeService}, Status: RateLimitStatus{ObservedGeneration: 1}},
			`{"metadata":{},"spec":{"rate":1,"match":{},"scope":"service"},"status":{"observedGeneration":1,"replicas":0}}`},
	} {
		got, err := json.Marshal(&c.rl)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != c.want {
			t.Errorf("got  %s\nwant %s", got, c.want)
		}
	}
}
