package v1alpha1

import (
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Defaults and bounds. They are the values the field comments and
// docs/config.md state.
const (
	DefaultPinDir         = "/sys/fs/bpf/rlagent"
	DefaultMetricsAddress = "127.0.0.1:9478"
	// MetricsOff as the metrics address serves no metrics.
	MetricsOff = "off"
	// SecureMetricsPort is the port deploy/monitoring's Service and
	// monitors scrape. It is not a default: secureMetrics.address left out
	// is off.
	SecureMetricsPort = 9479

	DefaultMaxBuckets = 65536
	MinMaxBuckets     = 1024
	MaxMaxBuckets     = 1 << 24

	DefaultStaticCount = 1

	// MaxNodeRate is the data path's largest node share, in units per
	// second (4e9 bytes/s is 32 Gbit/s). It is the data path's RL_MAX_RATE
	// (maps.MaxRate), typed again because this package cannot import maps;
	// a test in agent/ checks they agree.
	MaxNodeRate = 4_000_000_000
	// MaxGlobalRate bounds a limit's rate over all replicas. It is
	// MaxNodeRate: the count can fall to 1 (a count below 1 is treated as
	// 1), and then one node enforces the whole rate. A node share that still
	// does not fit (a spec that skipped validation) is clamped to
	// MaxNodeRate by the agent and reported.
	MaxGlobalRate = MaxNodeRate
	// MaxBurstSeconds bounds burst / rate; it is the data path's
	// RL_MAX_BURST_SECONDS (a test checks they agree).
	MaxBurstSeconds = 3600

	DefaultPrefixLengthIPv4 = 24
	DefaultPrefixLengthIPv6 = 64

	// DefaultHorizon, MinHorizon and MaxHorizon bound how long a paced
	// packet may wait. MaxHorizon is the data path's RL_MAX_HORIZON_NS
	// (maps.MaxHorizon; a test checks they agree).
	DefaultHorizon = 100 * time.Millisecond
	// DefaultMaxWait, MinMaxWait and MaxMaxWait bound how long a request
	// of a limit with unit requests and onEmpty wait may wait.
	DefaultMaxWait = time.Second
	MinMaxWait     = time.Millisecond
	MaxMaxWait     = time.Minute
	MinHorizon     = time.Millisecond
	MaxHorizon     = 4 * time.Second

	// The demand shares' parameters (DemandShares).
	DefaultDemandInterval = 15 * time.Second
	MinDemandInterval     = time.Second
	MaxDemandInterval     = 10 * time.Minute
	// DefaultDemandStaleIntervals x interval is staleAfter's default,
	// MinDemandStaleIntervals x interval its least.
	DefaultDemandStaleIntervals = 4
	MinDemandStaleIntervals     = 3
	MaxDemandStaleAfter         = time.Hour
	DefaultDemandFloorPerMille  = 10
	// DefaultHotKeys is hotKeys' default, and MaxHotKeys its most: 256
	// keys' allocations keep a RateLimit's status under 32 KiB.
	DefaultHotKeys         = 256
	MaxHotKeys             = 256
	MaxDemandFloorPerMille = 20

	// The reject budget's (RejectBudget): the kernel's own limits on
	// its ICMP errors (net.ipv4.icmp_msgs_per_sec, icmp_msgs_burst).
	DefaultRejectRate  = 1000
	DefaultRejectBurst = 50
	// Per destination (RejectBudget.PerDestination).
	DefaultRejectDestRate  = 100
	DefaultRejectDestBurst = 10
	MaxRejectRate          = 100_000
)

// Default applies every default of the file: its own and each limit's.
// It is idempotent, and it sets only fields that are empty.
func (c *Config) Default() {
	if c.PinDir == "" {
		c.PinDir = DefaultPinDir
	}
	if c.MetricsAddress == "" {
		c.MetricsAddress = DefaultMetricsAddress
	}
	if c.MaxBuckets == 0 {
		c.MaxBuckets = DefaultMaxBuckets
	}
	if c.Count.Static == nil && c.Count.File == "" {
		n := int32(DefaultStaticCount)
		c.Count.Static = &n
	}
	for i := range c.Limits {
		c.Limits[i].Default()
	}
	if c.Protect == nil { // left out; [] (not nil) turns protection off
		c.Protect = DefaultProtect()
	}
	for i := range c.Protect {
		c.Protect[i].Default()
	}
	if c.XDPFallback == "" {
		c.XDPFallback = XDPFallbackNone
	}
	if c.EndpointHook == "" {
		c.EndpointHook = EndpointHookHost
	}
	if c.EndpointSourceCheck == "" {
		c.EndpointSourceCheck = SourceCheckCount
	}
	c.DemandShares.Default()
	c.RejectBudget.Default()
	if c.ProtectAPIServer == nil {
		on := true
		c.ProtectAPIServer = &on
	}
}

// Default applies the defaults of the reject budget.
func (b *RejectBudget) Default() {
	if b.Rate == nil {
		r := uint32(DefaultRejectRate)
		b.Rate = &r
	}
	if b.Burst == nil {
		n := min(uint32(DefaultRejectBurst), max(*b.Rate, 1))
		b.Burst = &n
	}
	if b.PerDestination.Rate == nil {
		r := uint32(DefaultRejectDestRate)
		b.PerDestination.Rate = &r
	}
	if b.PerDestination.Burst == nil {
		n := min(uint32(DefaultRejectDestBurst), max(*b.PerDestination.Rate, 1))
		b.PerDestination.Burst = &n
	}
}

// Default applies the defaults of the demand shares' parameters.
func (d *DemandShares) Default() {
	if d.Interval == nil {
		d.Interval = &metav1.Duration{Duration: DefaultDemandInterval}
	}
	if d.StaleAfter == nil {
		d.StaleAfter = &metav1.Duration{Duration: DefaultDemandStaleIntervals * d.Interval.Duration}
	}
	if d.FloorPerMille == nil {
		f := uint32(DefaultDemandFloorPerMille)
		d.FloorPerMille = &f
	}
}

// HotKeyLimit is how many keys of a keyed demand-shared limit a node
// reports and the allocation holds at most: hotKeys, defaulted and held to
// 1..MaxHotKeys (a stored object may never have been validated).
func (s *RateLimitSpec) HotKeyLimit() int {
	if s.HotKeys == nil {
		return DefaultHotKeys
	}
	return int(min(max(*s.HotKeys, 1), MaxHotKeys))
}

// Default applies every default of a limit. It is idempotent, and it sets
// only fields that are empty.
//
// Burst is the exception: its default follows Rate, so it stays unset here
// and EffectiveBurst computes it whenever it is read. That way a config
// edited by `rlagent limits set NAME --rate R` keeps a burst that follows the
// new rate instead of a stale number written by an earlier Default.
func (s *RateLimitSpec) Default() {
	if s.Unit == "" {
		s.Unit = UnitPackets
	}
	if s.Match.Direction == "" {
		s.Match.Direction = DirectionIngress
	}
	if s.Match.Protocol == "" {
		s.Match.Protocol = ProtocolAny
	}
	if s.Key == "" {
		s.Key = KeyNone
	}
	if s.Key == KeySrcPrefix || s.Key == KeyDstPrefix {
		if s.PrefixLength == nil {
			s.PrefixLength = &PrefixLength{}
		}
		if s.PrefixLength.IPv4 == 0 {
			s.PrefixLength.IPv4 = DefaultPrefixLengthIPv4
		}
		if s.PrefixLength.IPv6 == 0 {
			s.PrefixLength.IPv6 = DefaultPrefixLengthIPv6
		}
	}
	if s.Scope == "" {
		// The file's default; the custom resource will have to set scope.
		s.Scope = ScopeStatic
	}
	if s.Action == "" {
		s.Action = ActionDrop
	}
	if s.Share == "" {
		s.Share = ShareEqual
	}
	if s.Share == ShareDemand && s.Key != KeyNone && s.HotKeys == nil {
		k := int32(DefaultHotKeys)
		s.HotKeys = &k
	}
	if s.Action == ActionPace && s.Horizon == nil {
		s.Horizon = &metav1.Duration{Duration: DefaultHorizon}
	}
	if s.Unit == UnitRequests {
		// Enforced in processes: no attach point, a policy instead.
		if s.OnEmpty == "" {
			s.OnEmpty = OnEmptyFail
		}
		if s.OnEmpty == OnEmptyWait && s.MaxWait == nil {
			s.MaxWait = &metav1.Duration{Duration: DefaultMaxWait}
		}
		return
	}
	if s.Attach == "" {
		s.Attach = AttachUplink
		if s.Scope == ScopeService || s.Scope == ScopePods {
			s.Attach = AttachEndpoints
		}
	}
}

// EffectiveBurst is the global burst: Burst when set, else Rate/10 and at
// least 1.
func (s *RateLimitSpec) EffectiveBurst() uint64 {
	if s.Burst != nil {
		return *s.Burst
	}
	return max(s.Rate/10, 1)
}
