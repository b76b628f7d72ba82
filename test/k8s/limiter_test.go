package k8s

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/nettest"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/limiter"
)

// The founding example in a service's own processes (examples/fanout):
// three processes stand in for three pods of the Service fanout, each
// running as the application's ServiceAccount with deploy/limiter's RBAC
// only, against the real API server.

// limiterPhase is how long each measured window lasts (RLAGENT_LIMITER_PHASE,
// make test-limiter's LIMITER_PHASE; make test
// runs 5 s, the least the issue allows).
func limiterPhase(t *testing.T) time.Duration {
	d := 5 * time.Second
	if v := os.Getenv("RLAGENT_LIMITER_PHASE"); v != "" {
		var err error
		if d, err = time.ParseDuration(v); err != nil || d < 5*time.Second {
			t.Fatalf("RLAGENT_LIMITER_PHASE=%q: a duration of at least 5s", v)
		}
	}
	return d
}

var fanoutBin = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "fanout-")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "fanout")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/rlagent/rlagent/examples/fanout").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build examples/fanout: %v\n%s", err, out)
	}
	return bin, nil
})

// fanoutProc is one running fanout process.
type fanoutProc struct {
	name string
	addr string
	cmd  *exec.Cmd
}

func startFanout(t *testing.T, kubeconfig, ns, name, consumer string, limits []string) *fanoutProc {
	t.Helper()
	bin, err := fanoutBin()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	addrFile := filepath.Join(dir, "addr")
	logFile, err := os.Create(filepath.Join(dir, "log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-service", "fanout", "-kubeconfig", kubeconfig, "-listen", "127.0.0.1:0",
		"-addr-file", addrFile, "-consumer", "sink="+consumer,
		"-per-source", limits[0], "-per-consumer", limits[1], "-sampler", limits[2])
	cmd.Env = append(os.Environ(), "POD_NAMESPACE="+ns, "POD_NAME="+name)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &fanoutProc{name: name, cmd: cmd}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		logFile.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logFile.Name())
			t.Logf("%s's log:\n%s", name, tailLines(string(b), 30))
		}
	})
	k8stest.WaitUntil(t, name+" listening", func() bool {
		b, err := os.ReadFile(addrFile)
		p.addr = string(b)
		return err == nil && p.addr != ""
	})
	return p
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(len(lines)-n, 0):], "\n")
}

// limits is what the process enforces now (its /limits).
func (p *fanoutProc) limits(t *testing.T) map[string]limiter.LimitConfig {
	t.Helper()
	resp, err := http.Get("http://" + p.addr + "/limits")
	if err != nil {
		t.Fatalf("%s: %v", p.name, err)
	}
	defer resp.Body.Close()
	out := map[string]limiter.LimitConfig{}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatalf("%s /limits: %v", p.name, err)
	}
	return out
}

// waitShare waits until every process in ps enforces limit at rate, and
// returns how long after since the slowest got there.
func waitShare(t *testing.T, ps []*fanoutProc, limit string, rate float64, since time.Time, timeout time.Duration) time.Duration {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var slowest time.Duration
	for _, p := range ps {
		for {
			c, ok := p.limits(t)[limit]
			if ok && c.Rate == rate {
				slowest = max(slowest, time.Since(since))
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %s is %+v (known %v), want rate %v within %v", p.name, limit, c, ok, rate, timeout)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return slowest
}

// fanoutSlice writes the Service fanout's EndpointSlice with ready of its
// three endpoints ready, as the EndpointSlice controller would.
func fanoutSlice(t *testing.T, env *k8stest.Env, ns string, ready int) {
	t.Helper()
	s := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "fanout-1", Namespace: ns,
			Labels: map[string]string{discoveryv1.LabelServiceName: "fanout", discoveryv1.LabelManagedBy: sliceController}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr("http"), Port: ptr[int32](8080), Protocol: ptr(corev1.ProtocolTCP)}},
	}
	for i := 1; i <= 3; i++ {
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{fmt.Sprintf("10.245.0.%d", i)},
			Conditions: discoveryv1.EndpointConditions{Ready: ptr(i <= ready)},
			TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: fmt.Sprintf("fanout-%d", i)},
		})
	}
	c := env.Clientset().DiscoveryV1().EndpointSlices(ns)
	cur, err := c.Get(t.Context(), s.Name, metav1.GetOptions{})
	if err == nil {
		s.ResourceVersion = cur.ResourceVersion
		_, err = c.Update(t.Context(), s, metav1.UpdateOptions{})
	} else {
		_, err = c.Create(t.Context(), s, metav1.CreateOptions{})
	}
	if err != nil {
		t.Fatalf("write the EndpointSlice: %v", err)
	}
}

// impersonatingKubeconfig writes env's kubeconfig acting as the
// application's ServiceAccount (ns/api), as its pod's token would.
func impersonatingKubeconfig(t *testing.T, env *k8stest.Env, ns string) string {
	t.Helper()
	cfg, err := clientcmd.LoadFromFile(env.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range cfg.AuthInfos {
		a.Impersonate = "system:serviceaccount:" + ns + ":api"
		a.ImpersonateGroups = []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// outcome is one request's answer.
type outcome struct {
	done    time.Time
	status  int
	latency time.Duration
}

// offered is what a load run saw.
type offered struct {
	outcomes []outcome
	errors   int
}

// admitted counts the 200s answered within [from, to).
func (o offered) admitted(from, to time.Time) int {
	n := 0
	for _, x := range o.outcomes {
		if x.status == http.StatusOK && !x.done.Before(from) && x.done.Before(to) {
			n++
		}
	}
	return n
}

func (o offered) count(status int) int {
	n := 0
	for _, x := range o.outcomes {
		if x.status == status {
			n++
		}
	}
	return n
}

// p99 is the 99th percentile of the latencies of the answers with status.
func (o offered) p99(status int) time.Duration {
	var ls []time.Duration
	for _, x := range o.outcomes {
		if x.status == status {
			ls = append(ls, x.latency)
		}
	}
	if len(ls) == 0 {
		return 0
	}
	slices.Sort(ls)
	return ls[(len(ls)*99)/100]
}

// openLoad publishes to each process at rate per second for d, whatever
// the answers (an open loop: offered load does not slow down when
// refused), with at most 64 requests in flight per process. It stops by
// itself after d.
func openLoad(ps []*fanoutProc, rate int, d time.Duration) offered {
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	defer client.CloseIdleConnections()
	var mu sync.Mutex
	var res offered
	var wg sync.WaitGroup
	end := time.Now().Add(d)
	for _, p := range ps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem := make(chan struct{}, 64)
			var inner sync.WaitGroup
			tick := time.NewTicker(time.Second / time.Duration(rate))
			defer tick.Stop()
			for time.Now().Before(end) {
				<-tick.C
				select {
				case sem <- struct{}{}:
				default:
					mu.Lock()
					res.errors++ // the server is too slow to keep the offer open
					mu.Unlock()
					continue
				}
				inner.Add(1)
				go func() {
					defer inner.Done()
					defer func() { <-sem }()
					o, err := publish(client, p.addr)
					mu.Lock()
					defer mu.Unlock()
					if err != nil {
						res.errors++
						return
					}
					res.outcomes = append(res.outcomes, o)
				}()
			}
			inner.Wait()
		}()
	}
	wg.Wait()
	return res
}

// closedLoad publishes to each process from workers clients, each sending
// its next request when its last was answered, at most at rate/workers
// per second each (2x the share: waits, not refusals, hold it back). It
// stops by itself after d.
func closedLoad(ps []*fanoutProc, workers, rate int, d time.Duration) offered {
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: workers}}
	defer client.CloseIdleConnections()
	var mu sync.Mutex
	var res offered
	var wg sync.WaitGroup
	end := time.Now().Add(d)
	gap := time.Second * time.Duration(workers) / time.Duration(rate)
	for _, p := range ps {
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for next := time.Now(); time.Now().Before(end); next = next.Add(gap) {
					time.Sleep(time.Until(next))
					o, err := publish(client, p.addr)
					mu.Lock()
					if err != nil {
						res.errors++
					} else {
						res.outcomes = append(res.outcomes, o)
					}
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	return res
}

func publish(client *http.Client, addr string) (outcome, error) {
	start := time.Now()
	resp, err := client.Post("http://"+addr+"/publish", "text/plain", strings.NewReader("hello"))
	if err != nil {
		return outcome{}, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	now := time.Now()
	return outcome{done: now, status: resp.StatusCode, latency: now.Sub(start)}, nil
}

// TestLimiterFanout: the "Done when" for requests in-process. A
// global 300 req/s per source over the Service's 3 ready endpoints gives
// each process 100; scaled to 2 ready endpoints, each takes 150 within 1 s
// of the EndpointSlice change; in each phase the processes together admit
// the global rate within 2% (admitted over rate x window, a window of
// LIMITER_PHASE starting 1 s after the change, the buckets long empty
// under a 2x offer). With onEmpty wait, a client at 2x waits (p99 within
// maxWait) instead of getting 429s. With the API server stopped, the last
// count stands.
func TestLimiterFanout(t *testing.T) {
	env := k8stest.Shared(t)
	installCRD(t, env)
	ns := env.Namespace(t)
	limiterApp(t, env, ns)
	nettest.HoldTraffic(t) // its rates are measured: not beside another package's traffic
	kubeconfig := impersonatingKubeconfig(t, env, ns)
	win := limiterPhase(t)
	const global = 300

	var sunk atomic.Int64
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { sunk.Add(1) }))
	t.Cleanup(sink.Close)

	fanoutSlice(t, env, ns, 3)
	svc := ns + "/fanout"
	spec := func(rate int64, extra map[string]any) map[string]any {
		s := map[string]any{"rate": rate, "unit": "requests", "scope": "service", "match": map[string]any{"service": svc}}
		for k, v := range extra {
			s[k] = v
		}
		return s
	}
	perSource := "fanout-per-source-" + ns
	names := []string{perSource, "fanout-per-consumer-" + ns, "fanout-sampler-" + ns}
	createRateLimit(t, env, rateLimit(names[0], spec(global, map[string]any{"key": "src-ip"})))
	createRateLimit(t, env, rateLimit(names[1], spec(100_000, map[string]any{"key": "custom"})))
	createRateLimit(t, env, rateLimit(names[2], spec(3, nil)))

	var ps []*fanoutProc
	for i := 1; i <= 3; i++ {
		ps = append(ps, startFanout(t, kubeconfig, ns, fmt.Sprintf("fanout-%d", i), sink.URL, names))
	}
	waitShare(t, ps, perSource, global/3, time.Now(), 30*time.Second)
	for _, p := range ps {
		got := p.limits(t)
		if len(got) != 3 || !got[perSource].Keyed || got[perSource].Replicas != 3 || got[names[2]].Rate != 1 {
			t.Fatalf("%s enforces %+v, want the three limits over 3 replicas", p.name, got)
		}
	}

	// measure offers 2x the share to ps for 1 s and a window, and checks
	// the admitted aggregate against the global rate.
	measure := func(what string, ps []*fanoutProc) offered {
		t.Helper()
		share := global / len(ps)
		start := time.Now()
		o := openLoad(ps, 2*share, time.Second+win)
		from := start.Add(time.Second)
		n := o.admitted(from, from.Add(win))
		want := float64(global) * win.Seconds()
		ratio := float64(n) / want
		t.Logf("%s: %d processes at 2x (%d req/s each): admitted %d in %v, %.4f of rate x window (%d refused with 429, %d errors)",
			what, len(ps), 2*share, n, win, ratio, o.count(http.StatusTooManyRequests), o.errors)
		if ratio < 0.98 || ratio > 1.02 {
			t.Errorf("%s: admitted %.4f of the global rate, want within 2%%", what, ratio)
		}
		if o.errors > 0 {
			t.Errorf("%s: %d requests failed or could not be offered", what, o.errors)
		}
		return o
	}
	measure("3 ready endpoints", ps)

	// 3 -> 2 ready endpoints: the third process is no longer ready (no
	// traffic reaches it); the other two take 150 each.
	changed := time.Now()
	fanoutSlice(t, env, ns, 2)
	took := waitShare(t, ps[:2], perSource, global/2, changed, 10*time.Second)
	t.Logf("3 -> 2 ready endpoints: both processes at %d req/s %v after the EndpointSlice write", global/2, took.Round(time.Millisecond))
	if took > time.Second {
		t.Errorf("the new share took %v, want within 1 s of the EndpointSlice change", took)
	}
	measure("2 ready endpoints", ps[:2])

	// onEmpty wait: a client at 2x waits instead of getting 429s.
	const maxWait = time.Second
	rl := dynamicClient(t, env).Resource(v1alpha1.RateLimitResource)
	obj, err := rl.Get(t.Context(), perSource, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	obj.Object["spec"].(map[string]any)["onEmpty"] = "wait"
	obj.Object["spec"].(map[string]any)["maxWait"] = maxWait.String()
	if _, err := rl.Update(t.Context(), obj, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	k8stest.WaitUntil(t, "onEmpty wait in both processes", func() bool {
		for _, p := range ps[:2] {
			if c := p.limits(t)[perSource]; c.OnEmpty != limiter.OnEmptyWait || c.MaxWait != maxWait {
				return false
			}
		}
		return true
	})
	start := time.Now()
	const workers = 20 // per process: a wait of about 20 / 150 s
	o := closedLoad(ps[:2], workers, 2*global/2, time.Second+win)
	from := start.Add(time.Second)
	n := o.admitted(from, from.Add(win))
	ratio := float64(n) / (float64(global) * win.Seconds())
	p99 := o.p99(http.StatusOK)
	t.Logf("onEmpty wait: %d clients per process offering 2x: %d answered 200, %d 429; p99 latency %v (maxWait %v); admitted %.4f of rate x window",
		workers, o.count(http.StatusOK), o.count(http.StatusTooManyRequests), p99.Round(time.Millisecond), maxWait, ratio)
	if r := o.count(http.StatusTooManyRequests); r > 0 {
		t.Errorf("onEmpty wait: %d requests refused with 429, want waits", r)
	}
	if p99 > maxWait {
		t.Errorf("onEmpty wait: p99 latency %v above maxWait %v", p99, maxWait)
	}
	if p99 < 50*time.Millisecond {
		t.Errorf("onEmpty wait: p99 latency %v: the requests did not wait (the offer is 2x)", p99)
	}
	if ratio < 0.98 || ratio > 1.02 {
		t.Errorf("onEmpty wait: admitted %.4f of the global rate, want within 2%%", ratio)
	}

	// The API server stops: the last count stands (and its age grows).
	if err := env.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := env.StartAPIServer(); err != nil {
			t.Errorf("restart the API server: %v", err)
		}
	})
	time.Sleep(2 * time.Second) // the watches notice
	for _, p := range ps[:2] {
		if c := p.limits(t)[perSource]; c.Rate != global/2 || c.Replicas != 2 || c.OnEmpty != limiter.OnEmptyWait {
			t.Fatalf("%s with the API server down: %+v, want what it last saw: 2 replicas, %d req/s, onEmpty wait", p.name, c, global/2)
		}
	}
	start = time.Now()
	o = closedLoad(ps[:2], workers, 2*global/2, time.Second+win)
	from = start.Add(time.Second)
	n = o.admitted(from, from.Add(win))
	ratio = float64(n) / (float64(global) * win.Seconds())
	t.Logf("API server down: the processes keep 2 replicas and %d req/s each: admitted %.4f of rate x window, %d 429; the sink received %d deliveries in all",
		global/2, ratio, o.count(http.StatusTooManyRequests), sunk.Load())
	if ratio < 0.98 || ratio > 1.02 {
		t.Errorf("API server down: admitted %.4f of the global rate, want within 2%%", ratio)
	}
}
