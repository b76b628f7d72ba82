package agent

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rlagent/rlagent/watcher"
)

// Health is true, and says why when it is not.
//
// Readiness (/readyz, and /healthz, which the readiness probe of the
// DaemonSet asks) means "this node enforces its share of the desired
// state": every configured interface attached, the last reconcile applied,
// and in a cluster the RateLimit caches synced. It feeds the `nodes` scope:
// the ready agents are the count every node divides by. That is why a stale
// count source does NOT make the agent unready: a node cut off from the API
// server still enforces its last share, and counting it out would make every
// other node admit more than the global rate. Staleness is reported instead
// (a note on /readyz, the status, a metric, a log line).
//
// Liveness (/livez) means "the agent's main loop still turns": it fails when
// the loop has not come round for livenessGrace, so that a kubelet restarts
// a wedged agent (the pins keep enforcing meanwhile).
type health struct {
	mu sync.Mutex
	// ifaces are the interfaces' states (a copy; a.mu guards the source).
	ifaces []InterfaceStatus
	// reconcileErr is the last reconcile's error; nil once one succeeds.
	reconcileErr error
	reconciled   time.Time // last success
	failed       time.Time // last failure
	unsynced     bool      // a cluster agent whose caches are not synced
	// problems are other reasons not to be ready, by source (another part
	// of the agent may set one); notes are reported but do not count.
	problems map[string]string
	notes    map[string]string
	beat     time.Time // the main loop's last turn
	// extra, if set, adds reasons and notes from elsewhere at each ask
	// (called without h.mu held).
	extra func() (problems, notes []string)
}

// livenessGrace is how long the main loop may stall before /livez fails.
// The loop turns every second; a reconcile holds it for milliseconds.
const livenessGrace = 30 * time.Second

func (h *health) setInterfaces(st []InterfaceStatus) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ifaces = slices.Clone(st)
}

// reconciled records a reconcile's outcome.
func (h *health) setReconcile(err error, now time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.reconcileErr = err
	if err == nil {
		h.reconciled = now
	} else {
		h.failed = now
	}
}

// retryDue reports whether the last reconcile failed, after or longer ago:
// nothing else may come to trigger the next one (a static count, an
// unchanged config), and the agent is not ready until one succeeds.
func (h *health) retryDue(now time.Time, after time.Duration) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.reconcileErr != nil && now.Sub(h.failed) >= after
}

func (h *health) setUnsynced(v bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.unsynced = v
}

// setProblem sets (reason != "") or clears a reason not to be ready.
func (h *health) setProblem(key, reason string) { h.set(&h.problems, key, reason) }

// setNote sets or clears a note: reported, but the agent stays ready.
func (h *health) setNote(key, reason string) { h.set(&h.notes, key, reason) }

func (h *health) set(m *map[string]string, key, reason string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if reason == "" {
		delete(*m, key)
		return
	}
	if *m == nil {
		*m = make(map[string]string)
	}
	(*m)[key] = reason
}

func (h *health) heartbeat(now time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.beat = now
}

// readiness returns the reasons not to be ready (none: ready) and the notes.
func (h *health) readiness() (problems, notes []string) {
	if h.extra != nil {
		problems, notes = h.extra()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	var own []string
	for _, s := range h.ifaces {
		if s.State != StateAttached {
			own = append(own, fmt.Sprintf("interface %s: %s", s.where(), s))
		}
	}
	problems = append(own, problems...)
	if h.reconcileErr != nil {
		problems = append(problems, "last reconcile failed: "+h.reconcileErr.Error())
	}
	if h.unsynced {
		problems = append(problems, "waiting for the cluster's RateLimit objects (caches not synced)")
	}
	for _, k := range sortedKeys(h.problems) {
		problems = append(problems, h.problems[k])
	}
	for _, k := range sortedKeys(h.notes) {
		notes = append(notes, h.notes[k])
	}
	return problems, notes
}

// serveReady answers 200 "ok" (and the notes) when ready, 503 with the
// reasons otherwise, one per line.
func (h *health) serveReady(w http.ResponseWriter, _ *http.Request) {
	problems, notes := h.readiness()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	var b strings.Builder
	if len(problems) == 0 {
		b.WriteString("ok\n")
	} else {
		w.WriteHeader(http.StatusServiceUnavailable)
		b.WriteString("not ready\n")
		for _, p := range problems {
			fmt.Fprintf(&b, "- %s\n", p)
		}
	}
	for _, n := range notes {
		fmt.Fprintf(&b, "note: %s\n", n)
	}
	w.Write([]byte(b.String()))
}

// serveLive answers 200 while the main loop turns.
func (h *health) serveLive(w http.ResponseWriter, _ *http.Request) {
	h.mu.Lock()
	beat := h.beat
	h.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if since := time.Since(beat); !beat.IsZero() && since > livenessGrace {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "main loop stalled for %s\n", since.Round(time.Second))
		return
	}
	fmt.Fprintln(w, "ok")
}

// Describe and Collect export the health as metrics.
func (h *health) Describe(ch chan<- *prometheus.Desc) {
	ch <- descInterfaceAttached
	ch <- descPaceIneffective
	ch <- descReconcileLastSuccess
	ch <- descReady
}

func (h *health) Collect(ch chan<- prometheus.Metric) {
	problems, _ := h.readiness()
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range h.ifaces {
		v := 0.0
		if s.State == StateAttached {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(descInterfaceAttached, prometheus.GaugeValue, v, s.Name, s.Hook, s.Program, s.Mode)
		if s.Qdisc != "" || s.PaceIneffective != "" {
			v = 0
			if s.PaceIneffective != "" {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(descPaceIneffective, prometheus.GaugeValue, v, s.Name)
		}
	}
	if !h.reconciled.IsZero() {
		ch <- prometheus.MustNewConstMetric(descReconcileLastSuccess, prometheus.GaugeValue,
			float64(h.reconciled.UnixNano())/1e9)
	}
	ready := 0.0
	if len(problems) == 0 {
		ready = 1
	}
	ch <- prometheus.MustNewConstMetric(descReady, prometheus.GaugeValue, ready)
}

// reconcileRecorded reconciles and records the outcome for health and
// metrics. Callers hold a.mu.
func (a *Agent) reconcileRecorded() error {
	err := a.reconcile()
	a.health.setReconcile(err, time.Now())
	a.health.setUnsynced(a.k8s != nil && !a.k8s.Synced())
	if err != nil && a.reconcileErrors != nil {
		a.reconcileErrors.Inc()
	}
	return err
}

// protectHealth reports protect rules that could not be written as a note:
// the limits are applied all the same, so the node enforces its share and
// stays ready (see health).
func (a *Agent) protectHealth() (problems, notes []string) {
	if st := a.Protection(); st.Err != nil {
		notes = append(notes, "protect rules not written (retrying): "+st.Err.Error())
	}
	return nil, notes
}

// reportStale notes, logs and clears the limits whose count source is
// unreadable: the last good count stands and the agent stays ready.
func (a *Agent) reportStale() {
	a.mu.Lock()
	limits := a.limits()
	obs := make(map[string]watcher.Observation, len(limits))
	for i := range limits {
		obs[limits[i].Name] = a.observe(&limits[i])
	}
	a.mu.Unlock()
	for _, name := range sortedKeys(a.health.notesWith(stalePrefix)) {
		if _, ok := obs[strings.TrimPrefix(name, stalePrefix)]; !ok {
			a.health.setNote(name, "") // the limit is gone
		}
	}
	for name, o := range obs {
		key := stalePrefix + name
		was := a.health.notesWith(key)[key] != ""
		switch {
		case o.Err != nil:
			a.health.setNote(key, fmt.Sprintf("limit %s: count source unreadable, the last good count (%d) stands: %v",
				name, o.Replicas, o.Err))
			if !was {
				a.log.Warn("count is stale: the last good count stands, and the agent stays ready (it still enforces its share)",
					"limit", name, "replicas", o.Replicas, "error", o.Err)
			}
		case was:
			a.health.setNote(key, "")
			a.log.Info("count is fresh again", "limit", name, "replicas", o.Replicas)
		}
	}
}

const stalePrefix = "stale/"

// notesWith returns the notes whose key starts with prefix.
func (h *health) notesWith(prefix string) map[string]string {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[string]string)
	for k, v := range h.notes {
		if strings.HasPrefix(k, prefix) {
			out[k] = v
		}
	}
	return out
}
