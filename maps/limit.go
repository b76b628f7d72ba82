package maps

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"

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
)

// Sentinel errors.
var (
	ErrUnknownLimit = errors.New("unknown limit")
	ErrTableFull    = errors.New("table full")
)

// Unit is what one token is worth.
type Unit uint8

const (
	Packets = Unit(bpf.RatelimitRlUnitRL_UNIT_PACKETS)
	Bytes   = Unit(bpf.RatelimitRlUnitRL_UNIT_BYTES)
)

// Action is what happens to a packet whose bucket is empty.
type Action uint8

const (
	Drop   = Action(bpf.RatelimitRlActionRL_ACTION_DROP)
	Shadow = Action(bpf.RatelimitRlActionRL_ACTION_SHADOW)
)

// KeyKind is how a limit splits its traffic into buckets.
type KeyKind uint8

const (
	KeyNone      = KeyKind(bpf.RatelimitRlKeyKindRL_KEY_NONE)
	KeySrcIP     = KeyKind(bpf.RatelimitRlKeyKindRL_KEY_SRC_IP)
	KeyDstIP     = KeyKind(bpf.RatelimitRlKeyKindRL_KEY_DST_IP)
	KeySrcPrefix = KeyKind(bpf.RatelimitRlKeyKindRL_KEY_SRC_PREFIX)
	KeyDstPort   = KeyKind(bpf.RatelimitRlKeyKindRL_KEY_DST_PORT)
)

// Protocol selects the packets a limit sees by their L4 protocol.
type Protocol uint8

const (
	AnyProtocol Protocol = iota
	TCP
	UDP
	ICMP // ICMP and ICMPv6
)

// Direction is the hook a limit applies at.
type Direction uint8

const (
	Ingress = Direction(bpf.RatelimitRlDirectionRL_DIR_INGRESS)
	Egress  = Direction(bpf.RatelimitRlDirectionRL_DIR_EGRESS)
)

// PortRange is an inclusive range of destination ports.
type PortRange struct{ First, Last uint16 }

// Match selects the packets a limit applies to. Empty lists match anything.
type Match struct {
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
	Prefix4 uint8 // KeySrcPrefix: IPv4 prefix length, 1..32
	Prefix6 uint8 // KeySrcPrefix: IPv6 prefix length, 1..128
	Action  Action
	Match   Match
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
	if l.Unit > Bytes {
		return fmt.Errorf("unit: %d is not one of packets (%d), bytes (%d)", l.Unit, Packets, Bytes)
	}
	if l.Action > Shadow {
		return fmt.Errorf("action: %d is not one of drop (%d), shadow (%d)", l.Action, Drop, Shadow)
	}
	switch l.Key {
	case KeyNone, KeySrcIP, KeyDstIP, KeyDstPort:
	case KeySrcPrefix:
		if l.Prefix4 < 1 || l.Prefix4 > 32 {
			return fmt.Errorf("prefix4: %d is not a prefix length in 1..32", l.Prefix4)
		}
		if l.Prefix6 < 1 || l.Prefix6 > 128 {
			return fmt.Errorf("prefix6: %d is not a prefix length in 1..128", l.Prefix6)
		}
	default:
		return fmt.Errorf("key: %d is not one of none, src-ip, dst-ip, src-prefix, dst-port", l.Key)
	}
	m := &l.Match
	if m.Direction > Egress {
		return fmt.Errorf("match.direction: %d is not one of ingress (%d), egress (%d)", m.Direction, Ingress, Egress)
	}
	if m.Protocol > ICMP {
		return fmt.Errorf("match.protocol: %d is not one of any, tcp, udp, icmp", m.Protocol)
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
func (l *Limit) needsNewBuckets(n *Limit) bool {
	return l.Unit != n.Unit || l.Key != n.Key || l.Prefix4 != n.Prefix4 || l.Prefix6 != n.Prefix6
}

func (l *Limit) clone() Limit {
	c := *l
	c.Match.DstPorts = slices.Clone(l.Match.DstPorts)
	c.Match.SrcCIDRs = slices.Clone(l.Match.SrcCIDRs)
	c.Match.DstCIDRs = slices.Clone(l.Match.DstCIDRs)
	return c
}

// String names the unit as the config file does.
func (u Unit) String() string {
	switch u {
	case Packets:
		return "packets"
	case Bytes:
		return "bytes"
	}
	return fmt.Sprintf("unit(%d)", uint8(u))
}

// String names the action as the config file does.
func (a Action) String() string {
	switch a {
	case Drop:
		return "drop"
	case Shadow:
		return "shadow"
	}
	return fmt.Sprintf("action(%d)", uint8(a))
}

// String names the key kind as the config file does.
func (k KeyKind) String() string {
	switch k {
	case KeyNone:
		return "none"
	case KeySrcIP:
		return "src-ip"
	case KeyDstIP:
		return "dst-ip"
	case KeySrcPrefix:
		return "src-prefix"
	case KeyDstPort:
		return "dst-port"
	}
	return fmt.Sprintf("key(%d)", uint8(k))
}

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
