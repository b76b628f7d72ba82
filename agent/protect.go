package agent

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/maps"
)

// Protected traffic: the node's lifeline passes before any limit is looked
// at. The rules are the config file's protect list and, in a cluster, one
// rule for the agent's own API server connection (the endpoints that
// opts.APIServer follows). They are written at start before the first
// attach, after every config reload, and whenever the API server's
// endpoints change.
//
// Failure isolation: a protect rule set that cannot be written never stops
// the limits from being applied. The failure is logged, counted, kept for
// /healthz (Agent.Protection) and retried every protectRetry.

const (
	// protectWait bounds how long start waits for the API server's
	// endpoints before the first attach.
	protectWait = 5 * time.Second
	// protectRetry is how often a failed write is tried again.
	protectRetry = 10 * time.Second
)

// ProtectState is what became of the protect rules, for /healthz, status
// and metrics.
type ProtectState struct {
	// Rules is how many rules the last successful write put in the data
	// path (the file's, plus one for the API server when it is protected).
	Rules int
	// APIServer are the API server endpoints that write protected (none
	// outside a cluster, or with protectAPIServer: false).
	APIServer []netip.AddrPort
	// APIServerOff: protectAPIServer is false in a cluster.
	APIServerOff bool
	// Waiting: the API server's endpoints are not known yet and limits are
	// in force, so the rules the pins hold (the previous agent's) stand
	// until they are; nothing was written.
	Waiting bool
	// Err is why the last write failed; nil when it succeeded. The limits
	// are applied whatever it says.
	Err error
	// At is when the rules were last written successfully; zero if never.
	At time.Time
	// Errors counts failed writes since start.
	Errors uint64
}

// protectState is the agent's record of its protect rules. Its zero value
// is ready. It has its own lock so that /healthz and metrics read it without
// waiting for a reconcile.
type protectState struct {
	mu  sync.Mutex
	st  ProtectState
	due chan struct{} // the API server's endpoints changed
}

// Protection returns what became of the protect rules: the number the
// health check and status read.
func (a *Agent) Protection() ProtectState {
	a.protect.mu.Lock()
	defer a.protect.mu.Unlock()
	st := a.protect.st
	st.APIServer = slices.Clone(st.APIServer)
	return st
}

// startProtect starts following the API server's endpoints (in a cluster),
// waits up to protectWait for the first read, and writes the rules. It runs
// before the first attach.
func (a *Agent) startProtect(ctx context.Context) {
	a.protect.mu.Lock()
	a.protect.due = make(chan struct{}, 1)
	a.protect.mu.Unlock()
	if s := a.opts.APIServer; s != nil {
		go s.Run(ctx, func() {
			select {
			case a.protect.due <- struct{}{}:
			default:
			}
		})
		deadline := time.Now().Add(protectWait)
		for {
			if _, known := s.Endpoints(); known || time.Now().After(deadline) || ctx.Err() != nil {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	a.mu.Lock()
	a.applyProtect("start")
	a.mu.Unlock()
	go a.protectLoop(ctx)
}

// protectLoop rewrites the rules when the API server's endpoints change,
// and retries a failed or deferred write.
func (a *Agent) protectLoop(ctx context.Context) {
	t := time.NewTicker(protectRetry)
	defer t.Stop()
	for {
		why := "API server endpoints"
		select {
		case <-ctx.Done():
			return
		case <-a.protect.due:
		case <-t.C:
			st := a.Protection()
			if st.Err == nil && !st.Waiting {
				continue
			}
			why = "retry"
		}
		a.mu.Lock()
		a.applyProtect(why)
		a.mu.Unlock()
	}
}

// applyProtect writes the protect rules of a.cfg and the API server's
// current endpoints. It never fails: a failure is logged, counted and
// recorded (see ProtectState). Callers hold a.mu.
func (a *Agent) applyProtect(why string) {
	wantAPI := a.opts.APIServer != nil && a.cfg.ProtectsAPIServer()
	var eps []netip.AddrPort
	known := true
	if wantAPI {
		eps, known = a.opts.APIServer.Endpoints()
	}
	if a.opts.APIServer != nil && !wantAPI && why != "API server endpoints" && why != "retry" {
		a.log.Warn("protectAPIServer is false: a limit can cut this agent off its API server, and the node off the fix")
	}

	a.protect.mu.Lock()
	prev := a.protect.st
	a.protect.mu.Unlock()

	if wantAPI && !known && len(a.dp.IDs()) > 0 {
		// The limits in force (adopted from the pins) could be dropping
		// the API server's replies that the endpoints would arrive in;
		// writing the file's rules alone would take away the rule the
		// previous agent wrote for them. Keep the pinned rules until the
		// endpoints are known.
		if !prev.Waiting {
			a.log.Warn("API server endpoints not known yet; the pinned protect rules stand until they are",
				"source", a.opts.APIServer.Describe(), "waited", protectWait)
		}
		a.protect.mu.Lock()
		a.protect.st.Waiting = true
		a.protect.mu.Unlock()
		return
	}

	rules, err := protectRules(a.cfg.Protect, eps)
	if err == nil {
		err = a.dp.SetProtected(rules)
	}
	a.protect.mu.Lock()
	st := &a.protect.st
	st.Waiting = false
	st.APIServerOff = a.opts.APIServer != nil && !wantAPI
	if err != nil {
		st.Err = fmt.Errorf("write protect rules (%s): %w", why, err)
		st.Errors++
		a.protect.mu.Unlock()
		a.log.Error("protect rules not written; the limits apply regardless, and the write is retried",
			"error", err, "rules", len(rules), "retry_in", protectRetry)
		return
	}
	st.Err, st.Rules, st.APIServer, st.At = nil, len(rules), eps, time.Now()
	a.protect.mu.Unlock()

	if prev.Err != nil {
		a.log.Info("protect rules written after earlier failures", "rules", len(rules))
	}
	if wantAPI && known && (why == "start" || !slices.Equal(prev.APIServer, eps) || prev.At.IsZero()) {
		if len(eps) == 0 {
			a.log.Warn("the API server lists no endpoints; the API server connection is not protected",
				"source", a.opts.APIServer.Describe())
		} else {
			a.log.Info("protecting the API server connection", "endpoints", eps, "source", a.opts.APIServer.Describe())
		}
	}
	if why != "API server endpoints" || prev.Rules != len(rules) {
		a.log.Debug("protect rules written", "rules", len(rules), "file", len(a.cfg.Protect), "why", why)
	}
}

// protectRules converts the file's protect list, and the API server's
// endpoints when there are any, into data path rules: the file's first, in
// order, then one for the API server. The list was validated with the
// config; an error here is a bug or a list that does not fit.
func protectRules(list []v1alpha1.Protect, apiServer []netip.AddrPort) ([]maps.ProtectRule, error) {
	rules := make([]maps.ProtectRule, 0, len(list)+1)
	for i := range list {
		p := list[i]
		p.Default()
		var (
			r   maps.ProtectRule
			err error
		)
		if r.Protocol, err = lookup("protocol", protocols, p.Protocol); err != nil || r.Protocol == maps.ICMP {
			return nil, fmt.Errorf("protect %s: protocol %q is not one of any, tcp, udp", p.Name, p.Protocol)
		}
		if r.Peers, err = prefixes("peers", p.Peers); err != nil {
			return nil, fmt.Errorf("protect %s: %w", p.Name, err)
		}
		if r.LocalPorts, err = portRanges("localPorts", p.LocalPorts); err != nil {
			return nil, fmt.Errorf("protect %s: %w", p.Name, err)
		}
		if r.RemotePorts, err = portRanges("remotePorts", p.RemotePorts); err != nil {
			return nil, fmt.Errorf("protect %s: %w", p.Name, err)
		}
		rules = append(rules, r)
	}
	if r, ok := apiServerRule(apiServer); ok {
		rules = append(rules, r)
	}
	if len(rules) > maps.MaxProtectRules {
		return nil, fmt.Errorf("%d protect rules is more than the data path's %d", len(rules), maps.MaxProtectRules)
	}
	return rules, nil
}

// apiServerRule is the rule for the API server's endpoints: TCP from each
// endpoint address (a host prefix) with each endpoint port as the remote
// port, i.e. the replies of the API server on ingress and the requests to it
// on egress. One rule holds them all, so with endpoints on different ports
// each address is protected on each of the ports: a little wider than the
// endpoints, in exchange for a fixed cost of one rule.
func apiServerRule(eps []netip.AddrPort) (maps.ProtectRule, bool) {
	if len(eps) == 0 {
		return maps.ProtectRule{}, false
	}
	r := maps.ProtectRule{Protocol: maps.TCP}
	var ports []uint16
	for _, ep := range eps {
		a := ep.Addr().Unmap()
		p := netip.PrefixFrom(a, a.BitLen())
		if !slices.Contains(r.Peers, p) {
			r.Peers = append(r.Peers, p)
		}
		if !slices.Contains(ports, ep.Port()) {
			ports = append(ports, ep.Port())
		}
	}
	slices.Sort(ports)
	for _, p := range ports {
		r.RemotePorts = append(r.RemotePorts, maps.PortRange{First: p, Last: p})
	}
	return r, true
}

var (
	descProtectRules     = desc("protect_rules", "Protect rules in the data path as this agent last wrote them (the file's, plus one for the API server).")
	descProtectAPIServer = desc("protect_apiserver_endpoints", "API server endpoints (address and port) protected; 0 outside a cluster, with protectAPIServer false, or while unknown.")
	descProtectFailing   = desc("protect_failing", "1 while the last write of the protect rules failed (the limits apply regardless; the write is retried).")
	descProtectWaiting   = desc("protect_waiting", "1 while the API server's endpoints are not known yet and the pinned protect rules stand.")
	descProtectErrors    = desc("protect_errors_total", "Writes of the protect rules that failed.")
)

// Describe and Collect make protectState a prometheus.Collector.
func (p *protectState) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descProtectRules, descProtectAPIServer, descProtectFailing, descProtectWaiting, descProtectErrors} {
		ch <- d
	}
}

func (p *protectState) Collect(ch chan<- prometheus.Metric) {
	p.mu.Lock()
	st := p.st
	p.mu.Unlock()
	b := func(v bool) float64 {
		if v {
			return 1
		}
		return 0
	}
	ch <- prometheus.MustNewConstMetric(descProtectRules, prometheus.GaugeValue, float64(st.Rules))
	ch <- prometheus.MustNewConstMetric(descProtectAPIServer, prometheus.GaugeValue, float64(len(st.APIServer)))
	ch <- prometheus.MustNewConstMetric(descProtectFailing, prometheus.GaugeValue, b(st.Err != nil))
	ch <- prometheus.MustNewConstMetric(descProtectWaiting, prometheus.GaugeValue, b(st.Waiting))
	ch <- prometheus.MustNewConstMetric(descProtectErrors, prometheus.CounterValue, float64(st.Errors))
}
