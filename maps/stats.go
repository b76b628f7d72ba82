package maps

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"

	"github.com/rlagent/rlagent/bpf"
)

// Stats are a limit's counters, summed over CPUs. Packets are segments (a
// GSO or GRO packet at TC counts each of its segments) and bytes are wire
// bytes (the headers each segment repeats included), whatever the limit's
// unit; a connections limit counts only the packets it was charged for
// (connection attempts).
type Stats struct {
	AdmittedPackets uint64 `json:"admittedPackets"`
	AdmittedBytes   uint64 `json:"admittedBytes"` // wire bytes, L2 header included
	DroppedPackets  uint64 `json:"droppedPackets"`
	DroppedBytes    uint64 `json:"droppedBytes"`
	ShadowPackets   uint64 `json:"shadowPackets"` // would have been dropped; passed (action shadow)
	ShadowBytes     uint64 `json:"shadowBytes"`
	NewKeys         uint64 `json:"newKeys"`      // keyed limits: buckets created for a new key
	ReturnedKeys    uint64 `json:"returnedKeys"` // keyed limits: keys back after their bucket was evicted
	// Paced limits: admitted packets that got a later departure, the
	// delay they got in all and the longest (ns), and packets dropped for
	// a departure beyond the horizon (also in DroppedPackets).
	PacedPackets    uint64 `json:"pacedPackets,omitempty"`
	PacedDelayNs    uint64 `json:"pacedDelayNs,omitempty"`
	PacedDelayMaxNs uint64 `json:"pacedDelayMaxNs,omitempty"`
	HorizonDrops    uint64 `json:"horizonDrops,omitempty"`
}

// Stats reads a limit's counters.
func (d *Datapath) Stats(id uint32) (Stats, error) {
	if _, ok := d.limits[id]; !ok {
		return Stats{}, fmt.Errorf("stats of limit %d: %w", id, ErrUnknownLimit)
	}
	var per []bpf.RatelimitRlLimitCpu
	if err := d.objs.RlPercpu.Lookup(id, &per); err != nil {
		return Stats{}, fmt.Errorf("stats of limit %d: %w", id, err)
	}
	var s Stats
	for _, c := range per {
		s.AdmittedPackets += c.Stats.AdmittedPackets
		s.AdmittedBytes += c.Stats.AdmittedBytes
		s.DroppedPackets += c.Stats.DroppedPackets
		s.DroppedBytes += c.Stats.DroppedBytes
		s.ShadowPackets += c.Stats.ShadowPackets
		s.ShadowBytes += c.Stats.ShadowBytes
		s.NewKeys += c.Stats.NewKeys
		s.ReturnedKeys += c.Stats.ReturnedKeys
	}
	if d.limits[id].limit.Action != Pace {
		return s, nil
	}
	var pace []bpf.RatelimitRlPaceStats
	if err := d.objs.RlPace.Lookup(id, &pace); err != nil {
		return Stats{}, fmt.Errorf("stats of limit %d: %w", id, err)
	}
	for _, c := range pace {
		s.PacedPackets += c.PacedPackets
		s.PacedDelayNs += c.PacedDelayNs
		s.PacedDelayMaxNs = max(s.PacedDelayMaxNs, c.PacedDelayMaxNs)
		s.HorizonDrops += c.HorizonDrops
	}
	return s, nil
}

// GlobalStats are counters that belong to no limit, summed over CPUs.
type GlobalStats struct {
	MatchOverflow  uint64 `json:"matchOverflow"` // packets matching more than MaxMatch limits
	LeaseContended uint64 `json:"leaseContended"`
	PoolFull       uint64 `json:"poolFull"` // new keys that found no room: passed unlimited
	// L4Unknown counts IP packets whose transport header could not be
	// found (charged to every limit that could match them).
	L4Unknown uint64 `json:"l4Unknown"`
	// FailClosed counts packets dropped because they matched a drop limit
	// beyond the MaxMatch the data path checks on one packet.
	FailClosed uint64 `json:"failClosed"`
	// Protected counts packets a protect rule passed before any limit.
	Protected uint64 `json:"protected"`
	// FragFirst counts first fragments recorded for their datagram's
	// later fragments; FragUnseen later fragments whose first was not seen
	// (L4-unknown).
	FragFirst  uint64 `json:"fragFirst"`
	FragUnseen uint64 `json:"fragUnseen"`
	// CacheBypass counts keyed checks that drew from the shared pool
	// directly: the packet already held both ways of the bucket's cache set.
	CacheBypass uint64 `json:"cacheBypass"`
	// Replies to packets that limits with action reject dropped: TCP
	// RST/ACKs and ICMP (or ICMPv6) port unreachables sent; rejects
	// dropped unanswered because the node's reply budget was spent, and
	// because the packet may not be answered (not a TCP SYN or UDP, a
	// fragment, IP options or IPv6 extension headers, a broadcast,
	// multicast or non-unicast address; at an endpoint's interface).
	RejectRST        uint64 `json:"rejectRst"`
	RejectICMP       uint64 `json:"rejectIcmp"`
	RejectBudget     uint64 `json:"rejectBudget"`
	RejectUnanswered uint64 `json:"rejectUnanswered"`
	// RejectDestBudget counts rejects dropped unanswered because the
	// reply's destination (the packet's source, an IPv6 /64) had its
	// replies (RejectBudget.PerDestination).
	RejectDestBudget uint64 `json:"rejectDestBudget"`
	// RejectNotLocal counts rejects dropped unanswered because the frame
	// was not to the receiving interface's MAC or the packet not to an
	// address the node owns or delivers (SetLocalAddresses).
	RejectNotLocal uint64 `json:"rejectNotLocal"`
	// EndpointSrcMismatch counts packets out of a local endpoint (at its
	// interface's egress limits) whose source was not one of the
	// endpoint's addresses: charged as the endpoint's, and dropped with
	// SourceDrop (SetSourceCheck). IPv6 link-local and unspecified
	// sources are not counted.
	EndpointSrcMismatch uint64 `json:"endpointSrcMismatch"`
	// HotRecords counts the hot keys recorded (Datapath.HotKeys): a key
	// whose bucket was short in two consecutive ticks, once a tick.
	HotRecords uint64 `json:"hotRecords"`
}

// GlobalStats reads the counters that belong to no limit.
func (d *Datapath) GlobalStats() (GlobalStats, error) {
	var per []bpf.RatelimitRlGlobalStats
	if err := d.objs.RlGlobal.Lookup(uint32(0), &per); err != nil {
		return GlobalStats{}, fmt.Errorf("global stats: %w", err)
	}
	var g GlobalStats
	for _, c := range per {
		g.MatchOverflow += c.MatchOverflow
		g.LeaseContended += c.LeaseContended
		g.PoolFull += c.PoolFull
		g.L4Unknown += c.L4Unknown
		g.FailClosed += c.FailClosed
		g.Protected += c.ProtectedPackets
		g.FragFirst += c.FragFirst
		g.FragUnseen += c.FragUnseen
		g.CacheBypass += c.CacheBypass
		g.RejectRST += c.RejectRst
		g.RejectICMP += c.RejectIcmp
		g.RejectBudget += c.RejectBudget
		g.RejectUnanswered += c.RejectUnanswered
		g.RejectDestBudget += c.RejectDestBudget
		g.RejectNotLocal += c.RejectNotLocal
		g.EndpointSrcMismatch += c.EndpointSrcMismatch
		g.HotRecords += c.HotRecords
	}
	return g, nil
}

// Bucket is one key's bucket of a keyed limit.
type Bucket struct {
	Addr   netip.Addr // src-ip, dst-ip, src-prefix, dst-prefix keys
	Prefix int        // src-prefix, dst-prefix keys: the prefix length
	Port   uint16     // dst-port keys
	// dst-port keys: the protocol class of the bucket (TCP, UDP, ICMP, or
	// AnyProtocol for other and unknown protocols). Packets without a port
	// (ICMP, other protocols, L4-unknown packets) share one bucket per
	// class, Port 0.
	Protocol Protocol
	// Tokens in the shared pool now; tokens leased to CPU caches (at most
	// a chunk per CPU) are not included.
	Tokens uint64
}

// Buckets lists the live buckets of a keyed limit.
func (d *Datapath) Buckets(id uint32) ([]Bucket, error) {
	in, ok := d.limits[id]
	if !ok {
		return nil, fmt.Errorf("buckets of limit %d: %w", id, ErrUnknownLimit)
	}
	now, err := d.clockOf(in.limit.Action)
	if err != nil {
		return nil, fmt.Errorf("buckets of limit %d: %w", id, err)
	}
	p := in.entry.Params[in.entry.Active&1]
	v := vclock(&p, now)
	var out []Bucket
	err = d.eachBucket(func(_ uint32, _ int, k *bpf.RatelimitRlBucketKey, vEmpty uint64) {
		if k.Limit != id || k.Gen != in.entry.Gen {
			return
		}
		b := bucketOf(&in.limit, k.Addr)
		if v > vEmpty {
			b.Tokens = min(v-vEmpty, p.Burst)
		}
		out = append(out, b)
	})
	if err != nil {
		return nil, fmt.Errorf("buckets of limit %d: %w", id, err)
	}
	return out, nil
}

// bucketOf is the key of l's bucket whose rl_bucket_key.addr is addr (the
// parser's words: IPv4 as ::ffff:a.b.c.d, the bytes in network order).
func bucketOf(l *Limit, addr [4]uint32) Bucket {
	var b Bucket
	switch l.Key {
	case KeyDstPort:
		b.Port = uint16(addr[1])
		switch int(addr[0]) {
		case classTCP:
			b.Protocol = TCP
		case classUDP:
			b.Protocol = UDP
		case classICMP:
			b.Protocol = ICMP
		}
		if addr[1] > 0xffff {
			b.Port = 0
		}
	default:
		var a [16]byte
		for i, w := range addr {
			binary.NativeEndian.PutUint32(a[4*i:], w)
		}
		b.Addr = netip.AddrFrom16(a).Unmap()
		if l.Key.prefixKey() {
			b.Prefix = int(l.Prefix6)
			if b.Addr.Is4() {
				b.Prefix = int(l.Prefix4)
			}
		}
	}
	return b
}

func sortedIDs(ids []uint32) []uint32 {
	slices.Sort(ids)
	return ids
}

// Evictions is how many of a keyed limit's buckets the map has evicted to
// make room for other keys: every bucket ever created (NewKeys +
// ReturnedKeys) less those still live. More than a few means MaxBuckets is
// too small for the number of live keys.
func (d *Datapath) Evictions(id uint32) (uint64, error) {
	st, err := d.Stats(id)
	if err != nil {
		return 0, err
	}
	bs, err := d.Buckets(id)
	if err != nil {
		return 0, err
	}
	created := st.NewKeys + st.ReturnedKeys
	return created - min(created, uint64(len(bs))), nil
}
