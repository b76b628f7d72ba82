package agent

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rlagent/rlagent/maps"
)

// scrapeWithin GETs url and fails the test if no answer came by the
// deadline; it returns the status code and the body.
func scrapeWithin(t *testing.T, url string, d time.Duration) (int, string) {
	t.Helper()
	type answer struct {
		code int
		body string
		err  error
	}
	done := make(chan answer, 1)
	go func() {
		resp, err := http.Get(url)
		if err != nil {
			done <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		done <- answer{resp.StatusCode, string(b), err}
	}()
	select {
	case a := <-done:
		if a.err != nil {
			t.Fatalf("GET %s: %v", url, a.err)
		}
		return a.code, a.body
	case <-time.After(d):
		t.Fatalf("GET %s: no answer after %v", url, d)
		return 0, ""
	}
}

// TestScrapeDoesNotWaitForTheLock: a scrape while the agent holds its
// lock (a long reconcile) is answered, from the snapshot the loop last
// wrote: a share that changed since shows its old value until the next
// update. Before, the scrape took the lock and walked the maps itself.
func TestScrapeDoesNotWaitForTheLock(t *testing.T) {
	src := &fakeSource{}
	src.set(1)
	a := newTestAgent(t, twoLimits, src)
	mustReconcile(t, a)
	snap := newSnapshot(&collector{read: a.readStatus}, clusterCollector{a})
	snap.update() // the loop's
	reg := prometheus.NewRegistry()
	reg.MustRegister(snap)
	srv, addr, err := a.serveMetrics("127.0.0.1:0", reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	url := "http://" + addr + "/metrics"
	const full, quarter = `rlagent_limit_share_rate{limit="dns",unit="packets"} 100000` + "\n", `rlagent_limit_share_rate{limit="dns",unit="packets"} 25000` + "\n"

	a.mu.Lock()
	code, body := scrapeWithin(t, url, 10*time.Second)
	a.mu.Unlock()
	if code != http.StatusOK || !strings.Contains(body, full) {
		t.Errorf("scrape with the lock held: %d, want 200 and %q in\n%.3000s", code, full, body)
	}

	src.set(4)
	mustReconcile(t, a)
	if _, body := scrapeWithin(t, url, 10*time.Second); !strings.Contains(body, full) {
		t.Errorf("before the next update the scrape shows another share than the snapshot's:\n%.3000s", body)
	}
	snap.update()
	if _, body := scrapeWithin(t, url, 10*time.Second); !strings.Contains(body, quarter) {
		t.Errorf("after the update: want %q in\n%.3000s", quarter, body)
	}
}

// blockingCollector holds a scrape until released.
type blockingCollector struct{ entered, release chan struct{} }

func (b blockingCollector) Describe(chan<- *prometheus.Desc) {}
func (b blockingCollector) Collect(chan<- prometheus.Metric) {
	b.entered <- struct{}{}
	<-b.release
}

// TestMetricsServerLimits: one scrape at a time (another one meanwhile is
// answered 503 at once, not queued), and the server has read, write and
// idle timeouts; the health probes are not held up by a scrape.
func TestMetricsServerLimits(t *testing.T) {
	a := &Agent{log: quiet()}
	b := blockingCollector{make(chan struct{}), make(chan struct{})}
	reg := prometheus.NewRegistry()
	reg.MustRegister(b)
	srv, addr, err := a.serveMetrics("127.0.0.1:0", reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	if srv.ReadTimeout <= 0 || srv.WriteTimeout <= 0 || srv.IdleTimeout <= 0 || srv.ReadHeaderTimeout <= 0 {
		t.Errorf("timeouts: read %v, write %v, idle %v, header %v; want all set", srv.ReadTimeout, srv.WriteTimeout, srv.IdleTimeout, srv.ReadHeaderTimeout)
	}
	url := "http://" + addr + "/metrics"
	first := make(chan int, 1)
	go func() {
		resp, err := http.Get(url)
		if err != nil {
			first <- 0
			return
		}
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	select {
	case <-b.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the first scrape did not reach the collector")
	}
	released := false
	defer func() {
		if !released {
			close(b.release)
		}
	}()
	for i := range 3 {
		if code, _ := scrapeWithin(t, url, 10*time.Second); code != http.StatusServiceUnavailable {
			t.Errorf("scrape %d during another: %d, want 503", i+2, code)
		}
	}
	if code, _ := scrapeWithin(t, "http://"+addr+"/livez", 10*time.Second); code == 0 {
		t.Errorf("/livez during a scrape: no answer")
	}
	close(b.release)
	released = true
	if code := <-first; code != http.StatusOK {
		t.Errorf("the first scrape: %d, want 200", code)
	}
}

// Every reason a reject goes unanswered has its label, with its own
// counter's value: not_local and destination_budget (issue 22) were
// counted by the data path and shown nowhere.
func TestRejectUnansweredReasons(t *testing.T) {
	g := maps.GlobalStats{RejectBudget: 1, RejectUnanswered: 2, RejectDestBudget: 3, RejectNotLocal: 4}
	c := &collector{read: func() ([]LimitStatus, maps.GlobalStats, error) { return nil, g, nil }}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "rlagent_datapath_reject_unanswered_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	want := map[string]float64{"budget": 1, "unanswerable": 2, "destination_budget": 3, "not_local": 4}
	for reason, v := range want {
		if got[reason] != v {
			t.Errorf("rlagent_datapath_reject_unanswered_total{reason=%q} = %v, want %v (all: %v)", reason, got[reason], v, got)
		}
	}
}
