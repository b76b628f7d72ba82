package cluster

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/watcher"
)

var apps = []string{"web", "api", "db"}

// testPod is pod i of a cluster of 100 namespaces: app web, api or db in
// turn, with the labels a Deployment's pod carries (one set per app and
// namespace), ready.
func testPod(i int) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("pod-%d", i), Namespace: fmt.Sprintf("ns-%d", i%100),
			UID: "00000000-0000-0000-0000-000000000000", ResourceVersion: "123456789",
			Labels: map[string]string{"app": apps[i%3], "pod-template-hash": fmt.Sprintf("5d8f7c9b%02d", i%100), "version": "v1"}},
		Spec: corev1.PodSpec{NodeName: fmt.Sprintf("node-%d", i/30)},
		Status: corev1.PodStatus{PodIP: "10.1.2.3", PodIPs: []corev1.PodIP{{IP: "10.1.2.3"}},
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
	}
}

// testNamespaces is a store of the 100 namespaces, the even ones team=shop.
func testNamespaces(tb testing.TB) cache.Store {
	nss := cache.NewStore(cache.MetaNamespaceKeyFunc)
	for i := range 100 {
		labels := map[string]string{"kubernetes.io/metadata.name": fmt.Sprintf("ns-%d", i)}
		if i%2 == 0 {
			labels["team"] = "shop"
		}
		ns, _ := watcher.SlimNamespace(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("ns-%d", i), Labels: labels}})
		if err := nss.Add(ns); err != nil {
			tb.Fatal(err)
		}
	}
	return nss
}

func podsLimit(name string, m v1alpha1.Match) *v1alpha1.Limit {
	return &v1alpha1.Limit{Name: name, RateLimitSpec: v1alpha1.RateLimitSpec{Scope: v1alpha1.ScopePods, Match: m}}
}

var (
	webPods   = &metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}}
	shopTeams = &metav1.LabelSelector{MatchLabels: map[string]string{"team": "shop"}}
)

// TestPodStoreCounts: the counts kept as pods come, change and go, and
// as namespaces change, equal a count made afresh over the same pods;
// the shared label sets are released with their last pod.
func TestPodStoreCounts(t *testing.T) {
	nss := testNamespaces(t)
	s := newPodStore(nss, func() {})
	var list []any
	for i := range 3000 {
		list = append(list, testPod(i))
	}
	if err := s.Replace(list, "1"); err != nil {
		t.Fatal(err)
	}
	limits := []*v1alpha1.Limit{
		podsLimit("web", v1alpha1.Match{PodSelector: webPods}),
		podsLimit("shop", v1alpha1.Match{NamespaceSelector: shopTeams}),
		podsLimit("web-shop", v1alpha1.Match{PodSelector: webPods, NamespaceSelector: shopTeams}),
		podsLimit("all", v1alpha1.Match{PodSelector: &metav1.LabelSelector{}}),
	}
	for _, tt := range []struct {
		l    *v1alpha1.Limit
		want int
	}{{limits[0], 1000}, {limits[1], 1500}, {limits[2], 500}, {limits[3], 3000}} {
		if n, ok := s.count(tt.l); !ok || n != tt.want {
			t.Errorf("%s: counted %d (%v), want %d", tt.l.Name, n, ok, tt.want)
		}
	}

	// Changes, then every count against a fresh store of the same pods.
	r := rand.New(rand.NewPCG(1, 2))
	live := make(map[string]*corev1.Pod)
	for _, obj := range list {
		p := obj.(*corev1.Pod)
		live[p.Namespace+"/"+p.Name] = p
	}
	for step := range 5000 {
		i := r.IntN(4000)
		p := testPod(i)
		key := p.Namespace + "/" + p.Name
		switch r.IntN(5) {
		case 0:
			p.Status.Conditions[0].Status = corev1.ConditionFalse
		case 1:
			p.Labels = map[string]string{"app": apps[r.IntN(3)]}
		case 2:
			if old, ok := live[key]; ok {
				if err := s.Delete(cache.DeletedFinalStateUnknown{Key: key, Obj: old}); err != nil {
					t.Fatal(err)
				}
				delete(live, key)
				continue
			}
		case 3:
			now := metav1.Now()
			p.DeletionTimestamp = &now
		}
		if err := s.Update(p); err != nil {
			t.Fatal(err)
		}
		live[key] = p
		if step == 2500 {
			// A namespace relabelled out of shop.
			ns, _ := watcher.SlimNamespace(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "ns-0"}})
			if err := nss.Update(ns); err != nil {
				t.Fatal(err)
			}
			s.namespacesChanged()
		}
	}
	fresh := newPodStore(nss, func() {})
	var now []any
	for _, p := range live {
		now = append(now, p)
	}
	if err := fresh.Replace(now, "2"); err != nil {
		t.Fatal(err)
	}
	for _, l := range limits {
		got, _ := s.count(l)
		want, _ := fresh.count(l)
		if got != want {
			t.Errorf("%s: kept count %d, a fresh count %d", l.Name, got, want)
		}
	}
	if len(s.shared) != len(fresh.shared) {
		t.Errorf("%d shared label sets kept, %d in use", len(s.shared), len(fresh.shared))
	}
}

// BenchmarkPodCount is the elected agent's cost of scope pods at 30,000
// and 150,000 pods (1,000 and 5,000 nodes of 30): a pod's event with 10
// limits of scope pods counted (ns/event), a count made afresh (ns/pod),
// and the store's heap (bytes/pod).
func BenchmarkPodCount(b *testing.B) {
	for _, n := range []int{30_000, 150_000} {
		b.Run(fmt.Sprintf("pods=%d", n), func(b *testing.B) {
			nss := testNamespaces(b)
			// The heap before the store and with it, its pods added one
			// by one as the watch adds them (nothing else held).
			var before, with runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			s := newPodStore(nss, func() {})
			for i := range n {
				if err := s.Add(testPod(i)); err != nil {
					b.Fatal(err)
				}
			}
			runtime.GC()
			runtime.ReadMemStats(&with)
			var limits []*v1alpha1.Limit
			for i := range 10 {
				limits = append(limits, podsLimit(fmt.Sprint(i), v1alpha1.Match{PodSelector: webPods, NamespaceSelector: shopTeams}))
				s.count(limits[i])
			}
			fresh := podsLimit("fresh", v1alpha1.Match{PodSelector: webPods, NamespaceSelector: shopTeams})
			pods := make([]*corev1.Pod, 1000)
			for i := range pods {
				pods[i] = testPod(i * 7)
				pods[i].Status.Conditions[0].Status = corev1.ConditionFalse
			}
			b.ResetTimer()
			events := 0
			var freshNS int64
			for b.Loop() {
				for _, p := range pods {
					if err := s.Update(p); err != nil {
						b.Fatal(err)
					}
				}
				events += len(pods)
				s.mu.Lock()
				delete(s.counts, fresh.Name)
				s.mu.Unlock()
				b.StopTimer()
				b.StartTimer()
			}
			perEvent := float64(b.Elapsed().Nanoseconds()) / float64(events)
			b.StopTimer()
			const counts = 5
			for range counts {
				s.mu.Lock()
				delete(s.counts, fresh.Name)
				s.mu.Unlock()
				start := nowNano()
				s.count(fresh)
				freshNS += nowNano() - start
			}
			b.ReportMetric(perEvent, "ns/event")
			b.ReportMetric(float64(freshNS)/counts/float64(n), "ns/pod-recount")
			b.ReportMetric((float64(with.HeapAlloc)-float64(before.HeapAlloc))/float64(n), "bytes/pod")
			runtime.KeepAlive(s)
		})
	}
}

func nowNano() int64 { return time.Now().UnixNano() }

// TestPodStoreListPaged: the list is asked for in pages of podPage, as a
// consistent list (no resourceVersion) of the pods that can match; the
// pages' pods are staged and put in place by the Reflector's Replace with
// the empty list listPaged returns, at the first page's resource version.
func TestPodStoreListPaged(t *testing.T) {
	const n = 1234
	var asked []metav1.ListOptions
	list := func(_ context.Context, o metav1.ListOptions) (*corev1.PodList, error) {
		asked = append(asked, o)
		from := 0
		if o.Continue != "" {
			fmt.Sscan(o.Continue, &from)
		}
		l := &corev1.PodList{ListMeta: metav1.ListMeta{ResourceVersion: "42"}}
		for i := from; i < min(from+int(o.Limit), n); i++ {
			l.Items = append(l.Items, *testPod(i))
		}
		if from+int(o.Limit) < n {
			l.Continue = fmt.Sprint(from + int(o.Limit))
		}
		return l, nil
	}
	s := newPodStore(testNamespaces(t), func() {})
	obj, err := s.listPaged(t.Context(), list, metav1.ListOptions{ResourceVersion: "0", Limit: 0})
	if err != nil {
		t.Fatal(err)
	}
	got := obj.(*corev1.PodList)
	if len(got.Items) != 0 || got.ResourceVersion != "42" {
		t.Errorf("listPaged returned %d pods at %q, want none at 42", len(got.Items), got.ResourceVersion)
	}
	if len(asked) != 3 {
		t.Fatalf("%d pages asked for, want 3", len(asked))
	}
	for i, o := range asked {
		if o.Limit != podPage || o.ResourceVersion != "" || o.FieldSelector != watcher.NotHostNetwork {
			t.Errorf("page %d asked with %+v, want limit %d, no resourceVersion, field selector %s", i, o, podPage, watcher.NotHostNetwork)
		}
	}
	if s.HasSynced() || len(s.pods) != 0 {
		t.Errorf("the staged pods are in place before Replace")
	}
	if err := s.Replace(nil, "42"); err != nil {
		t.Fatal(err)
	}
	if n, _ := s.count(podsLimit("all", v1alpha1.Match{PodSelector: &metav1.LabelSelector{}})); n != 1234 || !s.HasSynced() {
		t.Errorf("after Replace: %d pods counted (synced %v), want 1234", n, s.HasSynced())
	}
}
