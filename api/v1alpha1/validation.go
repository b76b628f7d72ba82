package v1alpha1

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	fieldpath "k8s.io/apimachinery/pkg/util/validation/field"
)

// FieldError is one broken rule: the field, named by its path from the top
// of the file (or of the object), and what is wrong with it.
type FieldError struct {
	Field  string // limits[2].match.dstPorts[0]
	Detail string // "70000" is not a port in 0..65535
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Detail }

// Validate checks a defaulted config file against every rule and returns
// every violation, joined with errors.Join in field order, each a
// *FieldError. It returns nil for a valid config.
//
// The file configures an agent on one host, so its limits are checked with
// ValidateStandalone: scopes nodes and service are rejected.
func (c *Config) Validate() error {
	var el errorList
	if len(c.Interfaces) == 0 {
		el.add("interfaces", "required: %s, or at least one network interface", InterfacesAuto)
	}
	ifaces := make(map[string]int)
	for i, name := range c.Interfaces {
		p := index("interfaces", i)
		if name == InterfacesAuto && !c.Interfaces.Auto() {
			el.add(p, "%q stands alone (interfaces: %s finds the uplinks); an interface named %s cannot be listed", name, InterfacesAuto, InterfacesAuto)
			continue
		}
		if err := validInterfaceName(name); err != nil {
			el.add(p, "%v", err)
			continue
		}
		if j, dup := ifaces[name]; dup {
			el.add(p, "%q is listed twice (first at interfaces[%d])", name, j)
			continue
		}
		ifaces[name] = i
	}
	if !filepath.IsAbs(c.PinDir) {
		el.add("pinDir", "%q is not an absolute path", c.PinDir)
	}
	if err := validMetricsAddress(c.MetricsAddress); err != nil {
		el.add("metricsAddress", "%v", err)
	}
	el = append(el, c.SecureMetrics.validate("secureMetrics", c.MetricsAddress)...)
	if c.MaxBuckets < MinMaxBuckets || c.MaxBuckets > MaxMaxBuckets {
		el.add("maxBuckets", "%d is not in %d..%d", c.MaxBuckets, MinMaxBuckets, MaxMaxBuckets)
	}
	switch c.XDPFallback {
	case XDPFallbackNone, XDPFallbackTC:
	default:
		el.add("xdpFallback", "%s", notOneOf(c.XDPFallback, Fallbacks))
	}
	switch c.EndpointHook {
	case EndpointHookHost, EndpointHookPod:
	default:
		el.add("endpointHook", "%s", notOneOf(c.EndpointHook, Hooks))
	}
	switch c.EndpointSourceCheck {
	case SourceCheckCount, SourceCheckDrop:
	default:
		el.add("endpointSourceCheck", "%s", notOneOf(c.EndpointSourceCheck, Checks))
	}
	el = append(el, c.Count.validate("count")...)
	names := make(map[string]int)
	for i := range c.Limits {
		l := &c.Limits[i]
		p := index("limits", i)
		el.uniqueName("limits", i, l.Name, names)
		el = append(el, l.RateLimitSpec.validate(p, true)...)
	}
	el = append(el, c.DemandShares.validate("demandShares")...)
	el = append(el, c.RejectBudget.validate("rejectBudget")...)
	el = append(el, c.validateProtect()...)
	return errors.Join(el...)
}

// validate checks a defaulted count source: the agent's config's, and the
// limiter library's file's.
func (c *CountSource) validate(path string) []error {
	var el errorList
	switch {
	case c.Static != nil && c.File != "":
		el.add(path, "set one of static, file, not both")
	case c.Static == nil && c.File == "":
		el.add(path, "set one of static, file")
	}
	if c.Static != nil && *c.Static < 0 {
		el.add(field(path, "static"), "%d is not a replica count: 0 or more (0 is treated as 1)", *c.Static)
	}
	if c.File != "" && !filepath.IsAbs(c.File) {
		el.add(field(path, "file"), "%q is not an absolute path", c.File)
	}
	return el
}

func (b *RejectBudget) validate(path string) []error {
	var el errorList
	if b.Rate != nil && *b.Rate > MaxRejectRate {
		el.add(field(path, "rate"), "%d is not in 0..%d (replies per second)", *b.Rate, MaxRejectRate)
	}
	if b.Rate != nil && b.Burst != nil && *b.Rate > 0 && (*b.Burst < 1 || *b.Burst > *b.Rate) {
		el.add(field(path, "burst"), "%d is not in 1..%d (the rate: the replies of one second)", *b.Burst, *b.Rate)
	}
	d, dpath := b.PerDestination, field(path, "perDestination")
	if d.Rate != nil && (*d.Rate < 1 || *d.Rate > MaxRejectRate) {
		el.add(field(dpath, "rate"), "%d is not in 1..%d (replies per second)", *d.Rate, MaxRejectRate)
	}
	if d.Rate != nil && d.Burst != nil && *d.Rate > 0 && (*d.Burst < 1 || *d.Burst > *d.Rate) {
		el.add(field(dpath, "burst"), "%d is not in 1..%d (the rate: the replies of one second)", *d.Burst, *d.Rate)
	}
	return el
}

func (d *DemandShares) validate(path string) []error {
	var el errorList
	if d.Interval != nil && (d.Interval.Duration < MinDemandInterval || d.Interval.Duration > MaxDemandInterval) {
		el.add(field(path, "interval"), "%v is not in %v..%v", d.Interval.Duration, MinDemandInterval, MaxDemandInterval)
	}
	if d.StaleAfter != nil && d.Interval != nil {
		least := MinDemandStaleIntervals * d.Interval.Duration
		if s := d.StaleAfter.Duration; s < least || s > MaxDemandStaleAfter {
			el.add(field(path, "staleAfter"), "%v is not in %v..%v: at least %d intervals (interval is %v), so that a steady allocation republished every third of it stays fresh",
				s, least, MaxDemandStaleAfter, MinDemandStaleIntervals, d.Interval.Duration)
		}
	}
	if f := d.FloorPerMille; f != nil && *f > MaxDemandFloorPerMille {
		el.add(field(path, "floorPerMille"), "%d is not in 0..%d (thousandths of the equal share)", *f, MaxDemandFloorPerMille)
	}
	return el
}

// Validate checks a defaulted spec against every rule that holds wherever
// the limit runs, and returns every violation joined in field order, each a
// *FieldError whose path starts with path (for example "limits[2]", or
// "spec" in a custom resource; "" for none). It allows every scope: the
// Kubernetes watcher provides nodes and service.
func (s *RateLimitSpec) Validate(path string) error {
	return errors.Join(s.validate(path, false)...)
}

// ValidateStandalone is Validate for an agent without Kubernetes, which
// also rejects the scopes nodes and service: they need the Kubernetes
// watcher.
func (s *RateLimitSpec) ValidateStandalone(path string) error {
	return errors.Join(s.validate(path, true)...)
}

func (s *RateLimitSpec) validate(path string, standalone bool) []error {
	var el errorList
	switch {
	case s.Rate == 0:
		el.add(field(path, "rate"), "required: 1..%d units per second over all replicas", uint64(MaxGlobalRate))
	case s.Rate > MaxGlobalRate:
		// The count can fall to 1, and then one node enforces the whole
		// rate: a rate above what one node's data path takes could not be
		// enforced as written.
		el.add(field(path, "rate"), "%d is not in 1..%d: one node enforces at most %d units/s, and the replica count can fall to 1",
			s.Rate, uint64(MaxGlobalRate), uint64(MaxNodeRate))
	}
	switch s.Unit {
	case UnitPackets, UnitBytes:
	case UnitRequests:
		el = append(el, s.validateRequests(path)...)
	case UnitConnections:
		if p := s.Match.Protocol; p != ProtocolTCP && p != ProtocolAny && p != "" {
			el.add(field(path, "unit"), "connections counts TCP SYNs: it needs protocol tcp or any (protocol is %q)", p)
		}
	default:
		el.add(field(path, "unit"), "%s", notOneOf(s.Unit, Units))
	}
	if s.Burst != nil {
		b := *s.Burst
		switch {
		case b == 0:
			el.add(field(path, "burst"), "0 is not a burst: at least 1 (leave burst out for the default, rate/10)")
		case s.Rate >= 1 && s.Rate <= MaxGlobalRate && b > MaxBurstSeconds*s.Rate:
			el.add(field(path, "burst"), "%d is more than %d seconds of rate %d", b, MaxBurstSeconds, s.Rate)
		}
	}

	m := &s.Match
	mp := field(path, "match")
	switch m.Direction {
	case DirectionIngress, DirectionEgress:
	default:
		el.add(field(mp, "direction"), "%s", notOneOf(m.Direction, Directions))
	}
	switch m.Protocol {
	case ProtocolAny, ProtocolTCP, ProtocolUDP, ProtocolICMP:
	default:
		el.add(field(mp, "protocol"), "%s", notOneOf(m.Protocol, Protocols))
	}
	if len(m.DstPorts) > 0 && m.Protocol == ProtocolICMP {
		el.add(field(mp, "dstPorts"), "protocol icmp has no ports: dstPorts needs protocol tcp, udp or any")
	}
	for i, r := range m.DstPorts {
		if _, _, err := ParsePortRange(r); err != nil {
			el.add(index(field(mp, "dstPorts"), i), "%v", err)
		}
	}
	for i, c := range m.SrcCIDRs {
		if _, err := ParseCIDR(c); err != nil {
			el.add(index(field(mp, "srcCIDRs"), i), "%v", err)
		}
	}
	for i, c := range m.DstCIDRs {
		if _, err := ParseCIDR(c); err != nil {
			el.add(index(field(mp, "dstCIDRs"), i), "%v", err)
		}
	}
	switch {
	case m.Service != "":
		if s.Scope != ScopeService {
			el.add(field(mp, "service"), "only with scope service (scope is %q)", s.Scope)
		}
		if !isService(m.Service) {
			el.add(field(mp, "service"), "%q is not namespace/name (each 1..63 lowercase letters, digits and '-')", m.Service)
		}
	case s.Scope == ScopeService:
		el.add(field(mp, "service"), "required with scope service: the namespace/name of a Service")
	}
	switch {
	case m.SelectsPods():
		if s.Scope != ScopePods {
			at := "podSelector"
			if m.PodSelector == nil {
				at = "namespaceSelector"
			}
			el.add(field(mp, at), "only with scope pods (scope is %q)", s.Scope)
		}
		validSelector(&el, field(mp, "podSelector"), m.PodSelector)
		validSelector(&el, field(mp, "namespaceSelector"), m.NamespaceSelector)
	case s.Scope == ScopePods:
		el.add(field(mp, "podSelector"), "required with scope pods (or namespaceSelector, or both): the labels of the pods whose ready count divides the rate ({} is every pod)")
	}

	switch s.Key {
	case KeyNone, KeySrcIP, KeyDstIP, KeySrcPrefix, KeyDstPrefix:
	case KeyCustom:
		if s.Unit != UnitRequests {
			el.add(field(path, "key"), "custom is only allowed with unit requests (unit is %q): it is the application's key function", s.Unit)
		}
	case KeyDstPort:
		if m.Protocol == ProtocolICMP {
			el.add(field(path, "key"), "dst-port needs protocol tcp, udp or any: icmp has no ports")
		}
	default:
		el.add(field(path, "key"), "%s", notOneOf(s.Key, Keys))
	}
	if pl := s.PrefixLength; pl != nil {
		pp := field(path, "prefixLength")
		if s.Key != KeySrcPrefix && s.Key != KeyDstPrefix {
			el.add(pp, "only with key src-prefix or dst-prefix (key is %q)", s.Key)
		} else {
			if pl.IPv4 < 1 || pl.IPv4 > 32 {
				el.add(field(pp, "ipv4"), "%d is not in 1..32", pl.IPv4)
			}
			if pl.IPv6 < 1 || pl.IPv6 > 128 {
				el.add(field(pp, "ipv6"), "%d is not in 1..128", pl.IPv6)
			}
		}
	}
	switch s.Scope {
	case ScopeStatic:
	case ScopeNodes, ScopeService, ScopePods:
		if standalone {
			el.add(field(path, "scope"), "%q needs the Kubernetes watcher (run rlagent in a cluster); on one host use static", s.Scope)
		}
	default:
		el.add(field(path, "scope"), "%s", notOneOf(s.Scope, Scopes))
	}
	if s.OnEmpty != "" && s.Unit != UnitRequests {
		el.add(field(path, "onEmpty"), "only with unit requests (unit is %q): the kernel cannot make a packet wait on the way in (see action pace for egress)", s.Unit)
	}
	if s.MaxWait != nil && s.OnEmpty != OnEmptyWait {
		el.add(field(path, "maxWait"), "only with onEmpty wait (onEmpty is %q)", s.OnEmpty)
	}
	switch s.Action {
	case ActionDrop, ActionShadow, ActionReject:
		if s.Horizon != nil {
			el.add(field(path, "horizon"), "only with action pace (action is %q)", s.Action)
		}
		if s.Action == ActionReject && m.Direction != DirectionIngress {
			el.add(field(path, "action"), "reject needs match.direction ingress (direction is %q): it answers arriving packets", m.Direction)
		}
	case ActionPace:
		if m.Direction != DirectionEgress {
			el.add(field(path, "action"), "pace needs match.direction egress: pacing delays egress packets with EDT timestamps; ingress packets cannot be delayed")
		} else if s.Attach != AttachUplink {
			el.add(field(path, "action"), "pace needs attach uplink (attach is %q): the departure time is kept by the uplink's fq qdisc", s.Attach)
		}
		if h := s.Horizon; h != nil && (h.Duration < MinHorizon || h.Duration > MaxHorizon) {
			el.add(field(path, "horizon"), "%v is not in %v..%v", h.Duration, MinHorizon, MaxHorizon)
		}
	default:
		el.add(field(path, "action"), "%s", notOneOf(s.Action, Actions))
	}
	switch s.Share {
	case ShareEqual:
	case ShareDemand:
		if s.Scope != ScopeNodes && s.Scope != ScopeService && s.Scope != ScopePods {
			el.add(field(path, "share"), "demand needs scope nodes, service or pods (scope is %q): the nodes report their demands and read the allocation through the cluster", s.Scope)
		}
		if s.Action == ActionPace && s.Key != KeyNone {
			el.add(field(path, "share"), "demand with a key (%q) cannot pace: a paced limit's departure times are kept per limit, not per key share; use share equal, or key none", s.Key)
		}
	default:
		el.add(field(path, "share"), "%s", notOneOf(s.Share, Shares))
	}
	if k := s.HotKeys; k != nil {
		switch {
		case s.Share != ShareDemand || s.Key == KeyNone:
			el.add(field(path, "hotKeys"), "only allowed with share demand and a key (share is %q, key is %q)", s.Share, s.Key)
		case *k < 1 || *k > MaxHotKeys:
			el.add(field(path, "hotKeys"), "%d is not in 1..%d", *k, MaxHotKeys)
		}
	}
	switch s.Attach {
	case "":
		if s.Unit != UnitRequests {
			el.add(field(path, "attach"), "%s", notOneOf(s.Attach, Attaches))
		}
	case AttachUplink:
	case AttachEndpoints:
		// Without a Service the endpoints are the addresses on the
		// endpoint's side of the match.
		if m.Service == "" && s.Scope != ScopeService && s.Scope != ScopePods {
			side, list := "dstCIDRs", m.DstCIDRs
			if m.Direction == DirectionEgress {
				side, list = "srcCIDRs", m.SrcCIDRs
			}
			if len(list) == 0 {
				el.add(field(path, "attach"), "endpoints without match.service or scope pods takes the endpoint addresses from match.%s (the endpoint's side of a %s limit): list them, or use attach uplink", side, m.Direction)
			}
		}
	default:
		el.add(field(path, "attach"), "%s", notOneOf(s.Attach, Attaches))
	}
	return el
}

// validateRequests checks what a limit with unit requests may hold: it is
// enforced per request in the processes of a Service (or of one host, scope
// static), so the fields of the packet path do not apply.
func (s *RateLimitSpec) validateRequests(path string) []error {
	var el errorList
	if s.Scope == ScopeNodes || s.Scope == ScopePods {
		el.add(field(path, "scope"), "unit requests is enforced in the Service's own processes: scope service (divided by its ready endpoints) or static, not %s", s.Scope)
	}
	m, mp := &s.Match, field(path, "match")
	if m.Direction != DirectionIngress || m.Protocol != ProtocolAny || len(m.DstPorts) > 0 || len(m.SrcCIDRs) > 0 || len(m.DstCIDRs) > 0 {
		el.add(mp, "unit requests matches every request of the processes that enforce it: match may only name the Service (direction ingress, protocol any, no ports, no CIDRs)")
	}
	if !slices.Contains(RequestKeys, s.Key) && slices.Contains(Keys, s.Key) {
		el.add(field(path, "key"), "%q is not one of %s (the keys of unit requests: the client's address, or the application's key function)", s.Key, choices(RequestKeys))
	}
	if s.Action != ActionDrop && s.Action != ActionShadow && slices.Contains(Actions, s.Action) {
		el.add(field(path, "action"), "unit requests allows action drop or shadow (action is %q): onEmpty says whether a request fails or waits", s.Action)
	}
	if s.Share != ShareEqual && slices.Contains(Shares, s.Share) {
		el.add(field(path, "share"), "unit requests allows share equal only (share is %q)", s.Share)
	}
	if s.Attach != "" {
		el.add(field(path, "attach"), "not allowed with unit requests (attach is %q): no node installs the limit", s.Attach)
	}
	switch s.OnEmpty {
	case OnEmptyFail, OnEmptyWait:
	default:
		el.add(field(path, "onEmpty"), "%s", notOneOf(s.OnEmpty, OnEmpties))
	}
	if w := s.MaxWait; w != nil && (w.Duration < MinMaxWait || w.Duration > MaxMaxWait) {
		el.add(field(path, "maxWait"), "%v is not in %v..%v", w.Duration, MinMaxWait, MaxMaxWait)
	}
	return el
}

// ParsePortRange parses a destination port entry: "53" (first == last) or an
// inclusive range "8000-8080".
func ParsePortRange(s string) (first, last uint16, err error) {
	lo, hi, isRange := strings.Cut(s, "-")
	if !isRange {
		p, ok := parsePort(s)
		if !ok {
			return 0, 0, fmt.Errorf("%q is not a port in 0..65535", s)
		}
		return p, p, nil
	}
	first, ok := parsePort(lo)
	if !ok {
		return 0, 0, fmt.Errorf("%q is not a port range: %q is not a port in 0..65535", s, lo)
	}
	last, ok = parsePort(hi)
	if !ok {
		return 0, 0, fmt.Errorf("%q is not a port range: %q is not a port in 0..65535", s, hi)
	}
	if first > last {
		return 0, 0, fmt.Errorf("%q is not a port range: first port %d is above last %d", s, first, last)
	}
	return first, last, nil
}

func parsePort(s string) (uint16, bool) {
	n, err := strconv.ParseUint(s, 10, 16)
	return uint16(n), err == nil
}

// ParseCIDR parses an IPv4 or IPv6 network. A bare address is the host
// prefix (/32 or /128). Host bits are cleared: "10.1.2.3/8" is 10.0.0.0/8.
// IPv4-mapped IPv6 addresses are rejected: the data path sees those packets
// as IPv4, so such a prefix would never match.
func ParseCIDR(s string) (netip.Prefix, error) {
	bad := fmt.Errorf("%q is not an IPv4 or IPv6 CIDR or address", s)
	var p netip.Prefix
	if strings.Contains(s, "/") {
		var err error
		if p, err = netip.ParsePrefix(s); err != nil {
			return netip.Prefix{}, bad
		}
	} else {
		a, err := netip.ParseAddr(s)
		if err != nil || a.Zone() != "" {
			return netip.Prefix{}, bad
		}
		p = netip.PrefixFrom(a, a.BitLen())
	}
	if p.Addr().Is4In6() {
		return netip.Prefix{}, fmt.Errorf("%q is an IPv4-mapped IPv6 address: write it as IPv4", s)
	}
	return p.Masked(), nil
}

// validInterfaceName applies the kernel's dev_valid_name.
func validInterfaceName(s string) error {
	if len(s) == 0 || len(s) > 15 || s == "." || s == ".." ||
		strings.ContainsAny(s, "/: \t\n\v\f\r") {
		return fmt.Errorf("%q is not an interface name: 1..15 characters, not \".\" or \"..\", without '/', ':' or whitespace", s)
	}
	return nil
}

func validMetricsAddress(a string) error {
	if a == MetricsOff {
		return nil
	}
	_, port, err := net.SplitHostPort(a)
	if err != nil {
		return fmt.Errorf("%q is not %q or host:port (e.g. %s)", a, MetricsOff, DefaultMetricsAddress)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
		return fmt.Errorf("%q: port %q is not a number in 1..65535", a, port)
	}
	return nil
}

// validate checks the secure metrics listener; plain is metricsAddress,
// whose port it cannot share.
func (m *SecureMetrics) validate(path, plain string) []error {
	var el errorList
	if m.Address != "" {
		host, port, err := net.SplitHostPort(m.Address)
		switch n, perr := strconv.ParseUint(port, 10, 16); {
		case err != nil:
			el.add(field(path, "address"), "%q is not host:port (e.g. \":%d\", every address) or \"\" (off)", m.Address, SecureMetricsPort)
		case perr != nil || n == 0:
			el.add(field(path, "address"), "%q: port %q is not a number in 1..65535", m.Address, port)
		case plain != MetricsOff && sameListener(host, port, plain):
			el.add(field(path, "address"), "%q: metricsAddress %q has that port; the plain and the TLS listener need a port each", m.Address, plain)
		}
	}
	if m.CertDir != "" {
		switch {
		case m.Address == "":
			el.add(field(path, "certDir"), "set without address: certDir is the certificate of the listener at address (\"\": off)")
		case !filepath.IsAbs(m.CertDir):
			el.add(field(path, "certDir"), "%q is not an absolute path (a directory with tls.crt and tls.key)", m.CertDir)
		}
	}
	return el
}

// sameListener reports whether host:port would collide with the listener
// at addr: the same port, on the same host or on every address.
func sameListener(host, port, addr string) bool {
	h, p, err := net.SplitHostPort(addr)
	if err != nil || p != port {
		return false
	}
	every := func(h string) bool { return h == "" || h == "0.0.0.0" || h == "::" }
	return h == host || every(h) || every(host)
}

// isDNSLabel reports whether s is an RFC 1123 label: 1..63 lowercase
// letters, digits and '-', starting and ending with a letter or digit.
func isDNSLabel(s string) bool {
	if len(s) == 0 || len(s) > 63 || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

func isService(s string) bool {
	ns, name, ok := strings.Cut(s, "/")
	return ok && isDNSLabel(ns) && isDNSLabel(name)
}

// errorList collects FieldErrors in the order the rules are checked.
type errorList []error

// uniqueName checks the name of list[i]: required, a DNS label, not the
// name of an earlier entry (seen maps names to their index).
func (l *errorList) uniqueName(list string, i int, name string, seen map[string]int) {
	at := field(index(list, i), "name")
	switch j, dup := seen[name]; {
	case name == "":
		l.add(at, "required: 1..63 lowercase letters, digits and '-'")
	case !isDNSLabel(name):
		l.add(at, "%q is not a name: 1..63 lowercase letters, digits and '-', starting and ending with a letter or digit", name)
	case dup:
		l.add(at, "%q is already the name of %s[%d]", name, list, j)
	default:
		seen[name] = i
	}
}

func (l *errorList) add(field, format string, args ...any) {
	*l = append(*l, &FieldError{Field: field, Detail: fmt.Sprintf(format, args...)})
}

func field(path, name string) string {
	if path == "" {
		return name
	}
	return path + "." + name
}

func index(path string, i int) string { return fmt.Sprintf("%s[%d]", path, i) }

func notOneOf[T ~string](v T, valid []T) string {
	return fmt.Sprintf("%q is not one of %s", v, choices(valid))
}

func choices[T ~string](valid []T) string {
	s := make([]string, len(valid))
	for i, v := range valid {
		s[i] = string(v)
	}
	return strings.Join(s, ", ")
}

// validSelector checks a label selector as the API server checks a
// NetworkPolicy's: label keys and values, operators and their values.
func validSelector(el *errorList, at string, sel *metav1.LabelSelector) {
	if sel == nil {
		return
	}
	errs := metav1validation.ValidateLabelSelector(sel, metav1validation.LabelSelectorValidationOptions{}, fieldpath.NewPath(at))
	for _, e := range errs {
		el.add(e.Field, "%s", e.ErrorBody())
	}
	if len(errs) == 0 {
		if _, err := metav1.LabelSelectorAsSelector(sel); err != nil {
			el.add(at, "%v", err)
		}
	}
}
