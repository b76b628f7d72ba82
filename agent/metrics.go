package agent

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rlagent/rlagent/maps"
)

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc("rlagent_"+name, help, labels, nil)
}

var (
	descAdmittedPackets = desc("limit_admitted_packets_total", "Packets admitted by the limit, summed over CPUs.", "limit")
	descAdmittedBytes   = desc("limit_admitted_bytes_total", "Frame bytes admitted by the limit.", "limit")
	descDroppedPackets  = desc("limit_dropped_packets_total", "Packets the limit dropped.", "limit")
	descDroppedBytes    = desc("limit_dropped_bytes_total", "Frame bytes the limit dropped.", "limit")
	descShadowPackets   = desc("limit_shadow_dropped_packets_total", "Packets a shadow limit would have dropped (passed).", "limit")
	descShadowBytes     = desc("limit_shadow_dropped_bytes_total", "Frame bytes a shadow limit would have dropped (passed).", "limit")
	descPacedPackets    = desc("limit_paced_packets_total", "Packets a paced limit admitted with a later departure time (they waited in fq).", "limit")
	descPacedDelay      = desc("limit_paced_delay_seconds_total", "The delay a paced limit added, summed over its paced packets: divided by limit_paced_packets_total, the mean wait.", "limit")
	descPacedDelayMax   = desc("limit_paced_delay_max_seconds", "The longest delay a paced limit has added to a packet since its buckets were created.", "limit")
	descHorizonDrops    = desc("limit_horizon_drops_total", "Packets a paced limit dropped because their departure would have been beyond its horizon (also in limit_dropped_packets_total).", "limit")
	descShare           = desc("limit_share_rate", "This node's share of the limit, units per second.", "limit", "unit")
	descShareBurst      = desc("limit_share_burst", "This node's share of the burst, units.", "limit", "unit")
	descGlobalRate      = desc("limit_global_rate", "The limit's global rate over all replicas, units per second.", "limit", "unit")
	descReplicas        = desc("limit_observed_replicas", "The replica count the global rate is divided by.", "limit", "scope")
	descAge             = desc("limit_observation_age_seconds", "Age of the replica count; grows while the count source is unreachable.", "limit", "scope")
	descStale           = desc("limit_observation_stale", "1 while the count source's last read failed and the last good count stands.", "limit", "scope")
	descKeys            = desc("limit_keys", "Live buckets of a keyed limit.", "limit")
	descNewKeys         = desc("limit_new_keys_total", "Buckets created for keys seen for the first time.", "limit")
	descEvictions       = desc("limit_evictions_total", "Buckets evicted to make room for other keys: the bucket map is too small if this grows.", "limit")
	descLimitState      = desc("limit_state", "1 for what became of the limit on this node, 0 for the other states: applied (enforced at its share), clamped (share clamped to the data path's range), rejected (does not fit the data path; see rlagent status).", "limit", "state")
	descMatchOverflow   = desc("datapath_match_overflow_total", "Packets that matched more limits than the data path checks on one packet (16).")
	descFailClosed      = desc("datapath_fail_closed_total", "Packets dropped because a drop limit they matched was beyond the 16 the data path checks on one packet.")
	descL4Unknown       = desc("datapath_l4_unknown_packets_total", "IP packets whose transport header could not be found (long or unknown IPv6 header chains, tiny or orphan fragments, many VLAN tags): charged to every limit that could match them.")
	descProtected       = desc("datapath_protected_packets_total", "Packets a protect rule passed before any limit was looked at.")
	descFragFirst       = desc("datapath_fragments_first_total", "First fragments recorded so that their datagram's later fragments are charged to the same limits.")
	descFragUnseen      = desc("datapath_fragments_unseen_total", "Later fragments whose first fragment was not seen (L4-unknown).")
	descCacheBypass     = desc("datapath_key_cache_bypass_total", "Keyed checks that drew from the shared pool directly: the packet held both ways of the bucket's cache set.")
	descSrcMismatch     = desc("datapath_endpoint_src_mismatch_total", "Packets out of a local endpoint, at the interfaces of limits with attach endpoints and direction egress, whose source was not one of the endpoint's addresses: charged as the endpoint's, and dropped with endpointSourceCheck drop.")
	descRejectReplies   = desc("datapath_reject_replies_total", "Replies sent to packets that limits with action reject dropped, by kind: rst (TCP RST/ACK to a SYN), icmp (ICMP or ICMPv6 port unreachable to a UDP datagram).", "kind")
	descRejectDropped   = desc("datapath_reject_unanswered_total", "Packets that limits with action reject dropped without a reply, by reason: budget (the node's rejectBudget was spent), destination_budget (the reply's destination had spent its rejectBudget.perDestination), not_local (a frame not to the receiving interface's MAC, or to an address the node neither owns nor delivers), unanswerable (not a TCP SYN or UDP datagram, a bad checksum, a SYN with payload, a fragment, IP options or IPv6 extension headers, a broadcast, multicast or non-unicast address, or at an endpoint's interface).", "reason")
	descPoolFull        = desc("datapath_pool_full_total", "New keys that found no room in the bucket map and were passed unlimited.")
	descLeaseContended  = desc("datapath_lease_contended_total", "Leases that gave up on a contended bucket (the packet was rejected).")
	// Health (collected by health, not collector: it reads no map).
	descPaceIneffective      = desc("pace_ineffective", "1 while the paced limits that leave through an uplink are ineffective there: its qdisc is not fq, so their departure times do nothing (rlagent status and the log say why; manageQdisc: true puts fq there); 0 while fq paces them. Only for uplinks that paced limits leave through.", "interface")
	descInterfaceAttached    = desc("interface_attached", "1 while the data path is attached to the hook, 0 while its interface is missing or the attach failed (its traffic passes unlimited). hook: xdp, tc-ingress or tc-egress; program: uplink-in, uplink-out, endpoint-in or endpoint-out (the traffic it sees); mode: native or generic (XDP), tcx or clsact (TC).", "interface", "hook", "program", "mode")
	descReconcileLastSuccess = desc("reconcile_last_success_timestamp_seconds", "When a reconcile last applied the desired state (Unix time).")
	descReady                = desc("ready", "1 while /readyz answers 200: every interface attached and the last reconcile applied.")
)

// The metrics server's timeouts: a client that sends or reads slowly holds
// a connection that long at most.
const (
	metricsReadTimeout  = 10 * time.Second
	metricsWriteTimeout = 10 * time.Second
	metricsIdleTimeout  = 60 * time.Second
)

// snapshot serves the metrics its collectors gave at the last update, so
// that a scrape never takes the agent's lock or walks the data path's
// maps: the agent's loop updates it (every second), one scrape costs a copy
// of a slice, and the HTTP handler serves one scrape at a time
// (serveMetrics). A value is at most an update interval old.
type snapshot struct {
	from []prometheus.Collector

	mu      sync.Mutex // guards metrics
	metrics []prometheus.Metric
}

func newSnapshot(from ...prometheus.Collector) *snapshot { return &snapshot{from: from} }

// update collects from every collector and keeps the result for the
// scrapes. The collectors take the agent's lock as they need: callers do
// not hold it.
func (s *snapshot) update() {
	ch := make(chan prometheus.Metric)
	done := make(chan []prometheus.Metric)
	go func() {
		var ms []prometheus.Metric
		for m := range ch {
			ms = append(ms, m)
		}
		done <- ms
	}()
	for _, c := range s.from {
		c.Collect(ch)
	}
	close(ch)
	ms := <-done
	s.mu.Lock()
	s.metrics = ms
	s.mu.Unlock()
}

func (s *snapshot) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range s.from {
		c.Describe(ch)
	}
}

// Collect sends the metrics of the last update (none before the first).
func (s *snapshot) Collect(ch chan<- prometheus.Metric) {
	s.mu.Lock()
	ms := s.metrics
	s.mu.Unlock()
	for _, m := range ms {
		ch <- m
	}
}

// collector reads the data path when the snapshot is updated.
type collector struct {
	read func() ([]LimitStatus, maps.GlobalStats, error)
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descAdmittedPackets, descAdmittedBytes, descDroppedPackets, descDroppedBytes,
		descShadowPackets, descShadowBytes, descPacedPackets, descPacedDelay, descPacedDelayMax, descHorizonDrops, descShare, descShareBurst, descGlobalRate, descReplicas, descAge, descStale,
		descKeys, descNewKeys, descEvictions, descLimitState, descMatchOverflow, descPoolFull, descLeaseContended,
		descFailClosed, descL4Unknown, descProtected, descFragFirst, descFragUnseen, descCacheBypass, descSrcMismatch,
		descRejectReplies, descRejectDropped} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	limits, g, err := c.read()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(descAdmittedPackets, err)
		return
	}
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for _, l := range limits {
		counter(descAdmittedPackets, l.Totals.AdmittedPackets, l.Name)
		counter(descAdmittedBytes, l.Totals.AdmittedBytes, l.Name)
		counter(descDroppedPackets, l.Totals.DroppedPackets, l.Name)
		counter(descDroppedBytes, l.Totals.DroppedBytes, l.Name)
		counter(descShadowPackets, l.Totals.ShadowPackets, l.Name)
		counter(descShadowBytes, l.Totals.ShadowBytes, l.Name)
		if l.Action == maps.Pace.String() {
			counter(descPacedPackets, l.Totals.PacedPackets, l.Name)
			ch <- prometheus.MustNewConstMetric(descPacedDelay, prometheus.CounterValue, float64(l.Totals.PacedDelayNs)/1e9, l.Name)
			gauge(descPacedDelayMax, float64(l.Totals.PacedDelayMaxNs)/1e9, l.Name)
			counter(descHorizonDrops, l.Totals.HorizonDrops, l.Name)
		}
		gauge(descShare, float64(l.ShareRate), l.Name, l.Unit)
		gauge(descShareBurst, float64(l.ShareBurst), l.Name, l.Unit)
		gauge(descGlobalRate, float64(l.GlobalRate), l.Name, l.Unit)
		gauge(descReplicas, float64(l.Replicas), l.Name, l.Scope)
		gauge(descAge, max(l.ObservationAge, 0), l.Name, l.Scope)
		stale := 0.0
		if l.Stale {
			stale = 1
		}
		gauge(descStale, stale, l.Name, l.Scope)
		gauge(descKeys, float64(l.Keys), l.Name)
		counter(descNewKeys, l.Totals.NewKeys, l.Name)
		counter(descEvictions, l.Evictions, l.Name)
		for _, st := range []maps.MetaState{maps.Applied, maps.Clamped, maps.Rejected} {
			v := 0.0
			if l.State == st.String() {
				v = 1
			}
			gauge(descLimitState, v, l.Name, st.String())
		}
	}
	counter(descMatchOverflow, g.MatchOverflow)
	counter(descPoolFull, g.PoolFull)
	counter(descLeaseContended, g.LeaseContended)
	counter(descFailClosed, g.FailClosed)
	counter(descL4Unknown, g.L4Unknown)
	counter(descProtected, g.Protected)
	counter(descFragFirst, g.FragFirst)
	counter(descFragUnseen, g.FragUnseen)
	counter(descCacheBypass, g.CacheBypass)
	counter(descSrcMismatch, g.EndpointSrcMismatch)
	counter(descRejectReplies, g.RejectRST, "rst")
	counter(descRejectReplies, g.RejectICMP, "icmp")
	counter(descRejectDropped, g.RejectBudget, "budget")
	counter(descRejectDropped, g.RejectUnanswered, "unanswerable")
	counter(descRejectDropped, g.RejectDestBudget, "destination_budget")
	counter(descRejectDropped, g.RejectNotLocal, "not_local")
}

var (
	descWatchEvents   = desc("watch_events_total", "Watch events the agent's informers received from the API server, by informer (ratelimits, daemonset, endpointslices) and type (event: added, modified or deleted; bookmark).", "informer", "type")
	descWatchListed   = desc("watch_listed_objects_total", "Objects the agent's informers received in list responses, by informer (a relist after an outage or a watch that expired lists again).", "informer")
	descStatusWriter  = desc("status_writer", "1 while this agent holds the Lease and writes the RateLimits' status, else 0.")
	descDemandRefused = desc("demand_allocation_refused_total", "Rounds of a demand-shared limit's allocation (status.allocation) this node refused, by limit: not one an honest allocator writes (a time ahead of the node's clock, a water level above the rate, a floor above the equal share or 0, too many nodes); the node enforced its equal share instead.", "limit")
)

// clusterCollector reports the Kubernetes source's watches and whether
// this agent writes status.
type clusterCollector struct{ a *Agent }

func (c clusterCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descWatchEvents
	ch <- descWatchListed
	ch <- descStatusWriter
	ch <- descDemandRefused
}

func (c clusterCollector) Collect(ch chan<- prometheus.Metric) {
	c.a.mu.Lock()
	k, w := c.a.k8s, c.a.writer
	c.a.mu.Unlock()
	if k == nil {
		return
	}
	for name, s := range k.WatchStats() {
		ch <- prometheus.MustNewConstMetric(descWatchEvents, prometheus.CounterValue, float64(s.Events), name, "event")
		ch <- prometheus.MustNewConstMetric(descWatchEvents, prometheus.CounterValue, float64(s.Bookmarks), name, "bookmark")
		ch <- prometheus.MustNewConstMetric(descWatchListed, prometheus.CounterValue, float64(s.Listed), name)
	}
	leading := 0.0
	if w != nil && w.Leading() {
		leading = 1
	}
	ch <- prometheus.MustNewConstMetric(descStatusWriter, prometheus.GaugeValue, leading)
	for name, n := range c.a.demandRefusals() {
		ch <- prometheus.MustNewConstMetric(descDemandRefused, prometheus.CounterValue, float64(n), name)
	}
}
