package maps

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/rlagent/rlagent/bpf"
)

// Sizes of the data path, from the C definitions.
const (
	MaxLimits = uint32(bpf.RatelimitRlConstRL_MAX_LIMITS)
	MaxMatch  = int(bpf.RatelimitRlConstRL_MAX_MATCH)
	// MaxRate is the largest node share, in units per second.
	MaxRate = uint64(bpf.RatelimitRlConstRL_MAX_RATE)
	// MaxBurstSeconds bounds burst / rate.
	MaxBurstSeconds = uint64(bpf.RatelimitRlConstRL_MAX_BURST_SECONDS)
	// MaxHorizon is the longest horizon of a paced limit.
	MaxHorizon = time.Duration(bpf.RatelimitRlConstRL_MAX_HORIZON_NS)
)

// Sentinel errors.
var (
	ErrUnknownLimit = errors.New("unknown limit")
	ErrTableFull    = errors.New("table full")
)

// Unit is what one token is worth.
type Unit uint8

const (
	// Packets: a packet; at TC, each segment of a GSO or GRO packet.
	Packets = Unit(bpf.RatelimitRlUnitRL_UNIT_PACKETS)
	// Bytes: what goes on the wire, L2 header included (at TC, the headers
	// each segment of a GSO or GRO packet repeats count too).
	Bytes = Unit(bpf.RatelimitRlUnitRL_UNIT_BYTES)
	// Connections: a TCP SYN without ACK, RST or FIN costs 1; the limit's
	// other packets are not its (neither charged nor counted), except an
	// L4-unknown packet that could be TCP, which counts as one attempt.
	// A connections limit sees TCP only, whatever its Match.Protocol says.
	Connections = Unit(bpf.RatelimitRlUnitRL_UNIT_CONNECTIONS)
)

// Action is what happens to a packet whose bucket is empty.
type Action uint8

const (
	Drop   = Action(bpf.RatelimitRlActionRL_ACTION_DROP)
	Shadow = Action(bpf.RatelimitRlActionRL_ACTION_SHADOW)
	// Pace gives the packet an earliest departure time (EDT) at which its
	// tokens will have accrued, and drops it if that is more than the
	// limit's Horizon ahead. Only at UplinkOut: the TC egress of an
	// uplink, before its qdisc, which must be fq for the departure to
	// mean anything.
	Pace = Action(bpf.RatelimitRlActionRL_ACTION_PACE)
	// Reject drops the packet and answers it, if it may be answered and
	// the node's reply budget allows (SetRejectBudget): a TCP SYN with a
	// RST, a UDP datagram with an ICMP port unreachable. Only at UplinkIn
	// is a reply sent; at EndpointIn the packet is dropped unanswered
	// (counted: GlobalStats.RejectUnanswered).
	Reject = Action(bpf.RatelimitRlActionRL_ACTION_REJECT)
)

// KeyKind is how a limit splits its traffic into buckets.
type KeyKind uint8

const (
	KeyNone      = KeyKind(bpf.RatelimitRlKeyKindRL_KEY_NONE)
	KeySrcIP     = KeyKind(bpf.RatelimitRlKeyKindRL_KEY_SRC_IP)
	KeyDstIP     = KeyKind(bpf.RatelimitRlKeyKindRL_KEY_DST_IP)
	KeySrcPrefix = KeyKind(bpf.RatelimitRlKeyKindRL_KEY_SRC_PREFIX)
	KeyDstPort   = KeyKind(bpf.RatelimitRlKeyKindRL_KEY_DST_PORT)
	KeyDstPrefix = KeyKind(bpf.RatelimitRlKeyKindRL_KEY_DST_PREFIX)
)

// prefixKey reports whether k masks an address with Prefix4 / Prefix6.
func (k KeyKind) prefixKey() bool { return k == KeySrcPrefix || k == KeyDstPrefix }

// Protocol selects the packets a limit sees by their L4 protocol.
type Protocol uint8

const (
	AnyProtocol Protocol = iota
	TCP
	UDP
	ICMP // ICMP and ICMPv6
)

// Direction is the direction of the traffic a limit is about: into the
// host or the endpoint (Ingress), or out of it (Egress). It is the
// traffic's direction, not the kernel hook's: see Hook.
type Direction uint8

const (
	Ingress = Direction(bpf.RatelimitRlDirectionRL_DIR_INGRESS)
	Egress  = Direction(bpf.RatelimitRlDirectionRL_DIR_EGRESS)
)

// Attach is where a limit is enforced.
type Attach uint8

const (
	// Uplink: the host's uplink interfaces (XDP, or TC).
	Uplink = Attach(bpf.RatelimitRlAttachRL_ATTACH_UPLINK)
	// Endpoints: the interfaces of the local endpoints (TC).
	Endpoints = Attach(bpf.RatelimitRlAttachRL_ATTACH_ENDPOINTS)
)

// Hook is one attach point and one direction: the limits a program of the
// data path enforces. A limit is enforced at exactly one hook, so no packet
// is charged twice for one limit.
type Hook uint8

const (
	// UplinkIn: traffic coming in on an uplink. Program() (XDP), or
	// TCProgram(UplinkIn) on the uplink's TC ingress.
	UplinkIn = Hook(bpf.RatelimitRlHookRL_HOOK_UPLINK_IN)
	// UplinkOut: traffic leaving through an uplink: its TC egress.
	UplinkOut = Hook(bpf.RatelimitRlHookRL_HOOK_UPLINK_OUT)
	// EndpointIn: traffic into a local endpoint. The host sees it leave
	// through the TC egress of the endpoint's host-side veth (or, where a
	// CNI redirects past that hook, at the ingress of the endpoint's own
	// interface).
	EndpointIn = Hook(bpf.RatelimitRlHookRL_HOOK_ENDPOINT_IN)
	// EndpointOut: traffic out of a local endpoint: the TC ingress of its
	// host-side veth.
	EndpointOut = Hook(bpf.RatelimitRlHookRL_HOOK_ENDPOINT_OUT)
	// NumHooks is the number of hooks.
	NumHooks = int(bpf.RatelimitRlHookRL_HOOKS)
)

// Hook is the hook of traffic in direction d at attach point a.
func (a Attach) Hook(d Direction) Hook {
	return Hook(uint8(a)*uint8(bpf.RatelimitRlDirectionRL_DIRECTIONS) + uint8(d))
}

// Attach is the attach point of h.
func (h Hook) Attach() Attach { return Attach(uint8(h) / uint8(bpf.RatelimitRlDirectionRL_DIRECTIONS)) }

// Direction is the direction of the traffic h sees.
func (h Hook) Direction() Direction {
	return Direction(uint8(h) % uint8(bpf.RatelimitRlDirectionRL_DIRECTIONS))
}

// The names of the data path's enums, indexed by value: the config
// file's words (api/v1alpha1 spells them; TestEnumTables checks each
// layer against the others).
var (
	hookNames      = [...]string{UplinkIn: "uplink-in", UplinkOut: "uplink-out", EndpointIn: "endpoint-in", EndpointOut: "endpoint-out"}
	attachNames    = [...]string{Uplink: "uplink", Endpoints: "endpoints"}
	directionNames = [...]string{Ingress: "ingress", Egress: "egress"}
	unitNames      = [...]string{Packets: "packets", Bytes: "bytes", Connections: "connections"}
	protocolNames  = [...]string{AnyProtocol: "any", TCP: "tcp", UDP: "udp", ICMP: "icmp"}
	actionNames    = [...]string{Drop: "drop", Shadow: "shadow", Pace: "pace", Reject: "reject"}
	keyNames       = [...]string{KeyNone: "none", KeySrcIP: "src-ip", KeyDstIP: "dst-ip", KeySrcPrefix: "src-prefix",
		KeyDstPort: "dst-port", KeyDstPrefix: "dst-prefix"}
)

// nameOf is v's name in names, or "kind(v)" for a value without one.
func nameOf[T ~uint8](names []string, v T, kind string) string {
	if int(v) < len(names) && names[v] != "" {
		return names[v]
	}
	return fmt.Sprintf("%s(%d)", kind, uint8(v))
}

// String names the hook: "uplink-in", "endpoint-out", ...
func (h Hook) String() string { return nameOf(hookNames[:], h, "hook") }

// String names the attach point as the config file does.
func (a Attach) String() string { return nameOf(attachNames[:], a, "attach") }

// String names the direction as the config file does.
func (d Direction) String() string { return nameOf(directionNames[:], d, "direction") }

// PortRange is an inclusive range of destination ports.
type PortRange struct{ First, Last uint16 }

// Match selects the packets a limit applies to. Empty lists match anything.
type Match struct {
	// Attach and Direction are the one hook (Attach.Hook) whose program
	// enforces the limit. Setting the limit again with another Attach
	// moves it: it leaves its old hook before it reaches the new one, so
	// no packet is charged at both.
	Attach    Attach
	Direction Direction
	Protocol  Protocol
	DstPorts  []PortRange // TCP and UDP only
	SrcCIDRs  []netip.Prefix
	DstCIDRs  []netip.Prefix
}

// Limit is one limit as the data path enforces it at this node: Rate and
// Burst are the node's share, already divided.
type Limit struct {
	Rate    uint64 // units per second; 0 admits nothing
	Burst   uint64 // units; at least 1 unless Rate is 0
	Unit    Unit
	Key     KeyKind
	Prefix4 uint8 // KeySrcPrefix, KeyDstPrefix: IPv4 prefix length, 1..32
	Prefix6 uint8 // KeySrcPrefix, KeyDstPrefix: IPv6 prefix length, 1..128
	Action  Action
	// Horizon (Pace only): a packet that would have to wait longer is
	// dropped. 1 µs..MaxHorizon.
	Horizon time.Duration
	// Hot (keyed limits, not paced): record the keys whose buckets run
	// short (Datapath.HotKeys), for demand shares of keyed limits.
	Hot   bool
	Match Match
}

// Validate reports the first field that the data path cannot take.
func (l *Limit) Validate() error {
	if l.Rate > MaxRate {
		return fmt.Errorf("rate: %d is above the maximum node share %d units/s", l.Rate, MaxRate)
	}
	if l.Rate > 0 && l.Burst == 0 {
		return errors.New("burst: must be at least 1 when rate is above 0")
	}
	if l.Rate > 0 && l.Burst > MaxBurstSeconds*l.Rate {
		return fmt.Errorf("burst: %d is more than %d seconds of rate %d", l.Burst, MaxBurstSeconds, l.Rate)
	}
	if l.Rate == 0 && l.Burst > 0 {
		return errors.New("burst: must be 0 when rate is 0")
	}
	if l.Unit > Connections {
		return fmt.Errorf("unit: %d is not one of packets (%d), bytes (%d), connections (%d)", l.Unit, Packets, Bytes, Connections)
	}
	if l.Action > Reject {
		return fmt.Errorf("action: %d is not one of drop (%d), shadow (%d), pace (%d), reject (%d)", l.Action, Drop, Shadow, Pace, Reject)
	}
	if l.Action == Reject && l.Match.Direction != Ingress {
		return errors.New("action: reject answers arriving packets: it needs direction ingress")
	}
	if l.Action == Pace {
		if h := l.Match.Attach.Hook(l.Match.Direction); h != UplinkOut {
			return fmt.Errorf("action: pace works only at %v (direction egress, attach uplink), where the uplink's qdisc follows; this limit is at %v", UplinkOut, h)
		}
		if l.Horizon < time.Microsecond || l.Horizon > MaxHorizon {
			return fmt.Errorf("horizon: %v is not in %v..%v", l.Horizon, time.Microsecond, MaxHorizon)
		}
	} else if l.Horizon != 0 {
		return fmt.Errorf("horizon: only for action pace, not %v", l.Action)
	}
	if l.Hot && (l.Key == KeyNone || l.Action == Pace) {
		return errors.New("hot: only a keyed limit that is not paced records hot keys")
	}
	switch l.Key {
	case KeyNone, KeySrcIP, KeyDstIP, KeyDstPort:
	case KeySrcPrefix, KeyDstPrefix:
		if l.Prefix4 < 1 || l.Prefix4 > 32 {
			return fmt.Errorf("prefix4: %d is not a prefix length in 1..32", l.Prefix4)
		}
		if l.Prefix6 < 1 || l.Prefix6 > 128 {
			return fmt.Errorf("prefix6: %d is not a prefix length in 1..128", l.Prefix6)
		}
	default:
		return fmt.Errorf("key: %d is not one of none, src-ip, dst-ip, src-prefix, dst-port, dst-prefix", l.Key)
	}
	m := &l.Match
	if m.Attach > Endpoints {
		return fmt.Errorf("match.attach: %d is not one of uplink (%d), endpoints (%d)", m.Attach, Uplink, Endpoints)
	}
	if m.Direction > Egress {
		return fmt.Errorf("match.direction: %d is not one of ingress (%d), egress (%d)", m.Direction, Ingress, Egress)
	}
	if m.Protocol > ICMP {
		return fmt.Errorf("match.protocol: %d is not one of any, tcp, udp, icmp", m.Protocol)
	}
	if l.Unit == Connections && (m.Protocol == UDP || m.Protocol == ICMP) {
		return fmt.Errorf("unit: connections counts TCP SYNs, and match.protocol %s has none: use tcp or any", m.Protocol)
	}
	if len(m.DstPorts) > 0 && m.Protocol == ICMP {
		return errors.New("match.dstPorts: icmp has no ports")
	}
	for i, r := range m.DstPorts {
		if r.First > r.Last {
			return fmt.Errorf("match.dstPorts[%d]: %d-%d is not a range (first > last)", i, r.First, r.Last)
		}
	}
	for _, f := range []struct {
		name string
		list []netip.Prefix
	}{{"match.srcCIDRs", m.SrcCIDRs}, {"match.dstCIDRs", m.DstCIDRs}} {
		for i, p := range f.list {
			if !p.IsValid() {
				return fmt.Errorf("%s[%d]: not a valid CIDR", f.name, i)
			}
		}
	}
	return nil
}

// needsNewBuckets reports whether changing a limit from l to n changes what
// its buckets mean, so that the old ones must be discarded.
//
// A paced limit's buckets run on another clock (Datapath.paceNow) than the
// others': a limit that starts or stops pacing starts over too.
func (l *Limit) needsNewBuckets(n *Limit) bool {
	return l.Unit != n.Unit || l.Key != n.Key || l.Prefix4 != n.Prefix4 || l.Prefix6 != n.Prefix6 ||
		(l.Action == Pace) != (n.Action == Pace)
}

func (l *Limit) clone() Limit {
	c := *l
	c.Match.DstPorts = slices.Clone(l.Match.DstPorts)
	c.Match.SrcCIDRs = slices.Clone(l.Match.SrcCIDRs)
	c.Match.DstCIDRs = slices.Clone(l.Match.DstCIDRs)
	return c
}

// String names the unit as the config file does.
func (u Unit) String() string { return nameOf(unitNames[:], u, "unit") }

// String names the protocol as the config file does.
func (p Protocol) String() string { return nameOf(protocolNames[:], p, "protocol") }

// String names the action as the config file does.
func (a Action) String() string { return nameOf(actionNames[:], a, "action") }

// String names the key kind as the config file does.
func (k KeyKind) String() string { return nameOf(keyNames[:], k, "key") }

// chunk is how many tokens one CPU leases at a time: about a millisecond of
// refill, at most burst/(8 x nCPU) so that tokens held in CPU caches stay
// within an eighth of the burst, and at least 1.
func chunk(rate, burst uint64, ncpu int) uint64 {
	c := rate / 1000
	if lim := burst / (8 * uint64(max(ncpu, 1))); c > lim {
		c = lim
	}
	return max(c, 1)
}

// PrefixCapacity is how many prefixes each prefix table of the data path
// holds, per side and family.
type PrefixCapacity struct {
	Src4, Src6, Dst4, Dst6 uint32
}

// PrefixTables reads the prefix tables' sizes from the data path's object,
// without a kernel (for checks such as `rlagent validate`).
func PrefixTables() (PrefixCapacity, error) {
	spec, err := bpf.LoadRatelimit()
	if err != nil {
		return PrefixCapacity{}, fmt.Errorf("read data path ELF: %w", err)
	}
	size := func(name string) uint32 {
		if ms, ok := spec.Maps[name]; ok {
			return ms.MaxEntries
		}
		return 0
	}
	return PrefixCapacity{
		Src4: size(bpf.RatelimitMapRlSrc4), Src6: size(bpf.RatelimitMapRlSrc6),
		Dst4: size(bpf.RatelimitMapRlDst4), Dst6: size(bpf.RatelimitMapRlDst6),
	}, nil
}
