package maps

import (
	"encoding/binary"
	"math/big"
	"math/rand/v2"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/rlagent/rlagent/bpf"
)

// validLimit is a limit that uses every field, so that a table case breaks
// exactly one of them.
func validLimit() Limit {
	return Limit{
		Rate:    1000,
		Burst:   100,
		Unit:    Bytes,
		Key:     KeySrcPrefix,
		Prefix4: 24,
		Prefix6: 64,
		Action:  Shadow,
		Hot:     true,
		Match: Match{
			Direction: Egress,
			Protocol:  TCP,
			DstPorts:  []PortRange{{80, 80}, {8000, 8080}},
			SrcCIDRs:  []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("2001:db8::/32")},
			DstCIDRs:  []netip.Prefix{netip.MustParsePrefix("192.168.0.0/16")},
		},
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name   string
		modify func(*Limit)
		// field is the prefix the error must start with ("" = valid);
		// choices are words the message must list.
		field   string
		choices []string
	}{
		{name: "all fields set", modify: func(*Limit) {}},
		{name: "zero value", modify: func(l *Limit) { *l = Limit{} }},
		{name: "rate 0 burst 0 admits nothing", modify: func(l *Limit) { l.Rate, l.Burst = 0, 0 }},
		{name: "rate at MaxRate", modify: func(l *Limit) { l.Rate, l.Burst = MaxRate, MaxRate }},
		{name: "burst at MaxBurstSeconds x MaxRate", modify: func(l *Limit) { l.Rate, l.Burst = MaxRate, MaxBurstSeconds*MaxRate }},
		{name: "burst at MaxBurstSeconds x rate", modify: func(l *Limit) { l.Rate, l.Burst = 2, 2*MaxBurstSeconds }},
		{name: "burst 1", modify: func(l *Limit) { l.Rate, l.Burst = 1, 1 }},
		{name: "prefix lengths at their bounds", modify: func(l *Limit) { l.Prefix4, l.Prefix6 = 32, 128 }},
		{name: "prefix lengths 1", modify: func(l *Limit) { l.Prefix4, l.Prefix6 = 1, 1 }},
		{name: "prefix lengths ignored without src-prefix key", modify: func(l *Limit) { l.Key, l.Prefix4, l.Prefix6 = KeySrcIP, 0, 200 }},
		{name: "ports with any protocol", modify: func(l *Limit) { l.Match.Protocol = AnyProtocol }},
		{name: "udp", modify: func(l *Limit) { l.Match.Protocol = UDP }},
		{name: "icmp without ports", modify: func(l *Limit) { l.Match.Protocol, l.Match.DstPorts = ICMP, nil }},
		{name: "one-port range and full range", modify: func(l *Limit) { l.Match.DstPorts = []PortRange{{0, 0}, {0, 65535}} }},
		{name: "default routes", modify: func(l *Limit) {
			l.Match.SrcCIDRs = []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")}
		}},
		{name: "each key kind", modify: func(l *Limit) { l.Key = KeyDstPort }},
		{name: "dst-prefix key", modify: func(l *Limit) { l.Key = KeyDstPrefix }},
		{name: "connections", modify: func(l *Limit) { l.Unit = Connections }},
		{name: "connections, any protocol", modify: func(l *Limit) { l.Unit, l.Match.Protocol = Connections, AnyProtocol }},
		{name: "at the endpoints", modify: func(l *Limit) { l.Match.Attach = Endpoints }},
		{name: "pace at the uplinks' egress", modify: func(l *Limit) { l.Action, l.Horizon, l.Match.Direction, l.Hot = Pace, time.Second, Egress, false }},
		{name: "pace horizon at MaxHorizon", modify: func(l *Limit) { l.Action, l.Horizon, l.Match.Direction, l.Hot = Pace, MaxHorizon, Egress, false }},

		{name: "rate above MaxRate", modify: func(l *Limit) { l.Rate = MaxRate + 1 }, field: "rate:"},
		{name: "burst 0 with rate", modify: func(l *Limit) { l.Burst = 0 }, field: "burst:"},
		{name: "burst MaxBurstSeconds+1 seconds of rate", modify: func(l *Limit) { l.Rate, l.Burst = 2, 2*(MaxBurstSeconds+1) }, field: "burst:"},
		{name: "burst one unit above MaxBurstSeconds x rate", modify: func(l *Limit) { l.Rate, l.Burst = 2, 2*MaxBurstSeconds+1 }, field: "burst:"},
		{name: "burst with rate 0", modify: func(l *Limit) { l.Rate, l.Burst = 0, 1 }, field: "burst:"},
		{name: "unknown unit", modify: func(l *Limit) { l.Unit = Connections + 1 }, field: "unit:", choices: []string{"packets", "bytes", "connections"}},
		{name: "connections of udp", modify: func(l *Limit) { l.Unit, l.Match.Protocol = Connections, UDP }, field: "unit:", choices: []string{"tcp", "any"}},
		{name: "connections of icmp", modify: func(l *Limit) { l.Unit, l.Match.Protocol, l.Match.DstPorts = Connections, ICMP, nil }, field: "unit:"},
		{name: "unknown action", modify: func(l *Limit) { l.Action = Reject + 1 }, field: "action:", choices: []string{"drop", "shadow", "pace", "reject"}},
		{name: "reject on egress", modify: func(l *Limit) { l.Action, l.Match.Direction = Reject, Egress }, field: "action:", choices: []string{"ingress"}},
		{name: "pace at the endpoints' egress", modify: func(l *Limit) {
			l.Action, l.Horizon, l.Match.Attach, l.Match.Direction = Pace, time.Millisecond, Endpoints, Egress
		}, field: "action:", choices: []string{"uplink-out"}},
		{name: "pace on ingress", modify: func(l *Limit) { l.Action, l.Horizon, l.Match.Direction = Pace, time.Millisecond, Ingress }, field: "action:",
			choices: []string{"uplink-out", "uplink-in"}},
		{name: "pace without a horizon", modify: func(l *Limit) { l.Action, l.Match.Direction = Pace, Egress }, field: "horizon:"},
		{name: "pace horizon above MaxHorizon", modify: func(l *Limit) {
			l.Action, l.Horizon, l.Match.Direction = Pace, MaxHorizon+1, Egress
		}, field: "horizon:"},
		{name: "horizon without pace", modify: func(l *Limit) { l.Horizon = time.Millisecond }, field: "horizon:"},
		{name: "hot without a key", modify: func(l *Limit) { l.Key, l.Hot = KeyNone, true }, field: "hot:"},
		{name: "hot and paced", modify: func(l *Limit) {
			l.Action, l.Horizon, l.Match.Direction, l.Hot = Pace, time.Millisecond, Egress, true
		}, field: "hot:"},
		{name: "unknown key", modify: func(l *Limit) { l.Key = KeyDstPrefix + 1 }, field: "key:",
			choices: []string{"none", "src-ip", "dst-ip", "src-prefix", "dst-port", "dst-prefix"}},
		{name: "dst-prefix prefix4 0", modify: func(l *Limit) { l.Key, l.Prefix4 = KeyDstPrefix, 0 }, field: "prefix4:"},
		{name: "dst-prefix prefix6 129", modify: func(l *Limit) { l.Key, l.Prefix6 = KeyDstPrefix, 129 }, field: "prefix6:"},
		{name: "prefix4 0", modify: func(l *Limit) { l.Prefix4 = 0 }, field: "prefix4:"},
		{name: "prefix4 33", modify: func(l *Limit) { l.Prefix4 = 33 }, field: "prefix4:"},
		{name: "prefix6 0", modify: func(l *Limit) { l.Prefix6 = 0 }, field: "prefix6:"},
		{name: "prefix6 129", modify: func(l *Limit) { l.Prefix6 = 129 }, field: "prefix6:"},
		{name: "unknown direction", modify: func(l *Limit) { l.Match.Direction = Egress + 1 }, field: "match.direction:",
			choices: []string{"ingress", "egress"}},
		{name: "unknown attach", modify: func(l *Limit) { l.Match.Attach = Endpoints + 1 }, field: "match.attach:",
			choices: []string{"uplink", "endpoints"}},
		{name: "unknown protocol", modify: func(l *Limit) { l.Match.Protocol = ICMP + 1 }, field: "match.protocol:",
			choices: []string{"any", "tcp", "udp", "icmp"}},
		{name: "icmp with ports", modify: func(l *Limit) { l.Match.Protocol = ICMP }, field: "match.dstPorts"},
		{name: "port range first > last", modify: func(l *Limit) { l.Match.DstPorts[1] = PortRange{8080, 8000} }, field: "match.dstPorts[1]:"},
		{name: "invalid src CIDR", modify: func(l *Limit) { l.Match.SrcCIDRs[1] = netip.Prefix{} }, field: "match.srcCIDRs[1]:"},
		{name: "invalid dst CIDR", modify: func(l *Limit) { l.Match.DstCIDRs[0] = netip.PrefixFrom(netip.MustParseAddr("10.0.0.0"), 33) }, field: "match.dstCIDRs[0]:"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := validLimit()
			tt.modify(&l)
			err := l.Validate()
			if tt.field == "" {
				if err != nil {
					t.Fatalf("Validate(%+v) = %v, want nil", l, err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate(%+v) = nil, want an error about %q", l, tt.field)
			}
			if !strings.HasPrefix(err.Error(), tt.field) {
				t.Errorf("Validate error %q does not start with the field %q", err, tt.field)
			}
			for _, c := range tt.choices {
				if !strings.Contains(err.Error(), c) {
					t.Errorf("Validate error %q does not list the choice %q", err, c)
				}
			}
		})
	}
}

func TestChunk(t *testing.T) {
	tests := []struct {
		rate, burst uint64
		ncpu        int
		want        uint64
	}{
		{rate: 1_000_000, burst: 1_000_000, ncpu: 2, want: 1000}, // a millisecond of refill
		{rate: 1_000_000, burst: 1000, ncpu: 2, want: 62},        // burst / 16
		{rate: 1_000_000, burst: 1000, ncpu: 1, want: 125},       // burst / 8
		{rate: 1_000_000, burst: 80, ncpu: 0, want: 10},          // ncpu 0 counts as 1
		{rate: 1_000_000, burst: 80, ncpu: -3, want: 10},
		{rate: 500, burst: 100, ncpu: 1, want: 1}, // under a token per ms
		{rate: 1_000_000, burst: 1, ncpu: 64, want: 1},
		{rate: 0, burst: 0, ncpu: 4, want: 1},
		{rate: MaxRate, burst: MaxRate * MaxBurstSeconds, ncpu: 1024, want: MaxRate / 1000},
	}
	for _, tt := range tests {
		if got := chunk(tt.rate, tt.burst, tt.ncpu); got != tt.want {
			t.Errorf("chunk(%d, %d, %d) = %d, want %d", tt.rate, tt.burst, tt.ncpu, got, tt.want)
		}
	}

	// The bound the data path relies on: tokens stranded in other CPUs'
	// caches, nCPU x (chunk-1), stay within burst/8.
	r := rand.New(rand.NewPCG(1, 2))
	for range 10000 {
		rate := r.Uint64N(MaxRate + 1)
		burst := 1 + r.Uint64N(max(rate, 1)*10)
		ncpu := 1 + r.IntN(512)
		c := chunk(rate, burst, ncpu)
		if c < 1 || c > max(rate/1000, 1) {
			t.Fatalf("chunk(%d, %d, %d) = %d, want 1..max(rate/1000, 1)", rate, burst, ncpu, c)
		}
		if uint64(ncpu)*(c-1) > burst/8 {
			t.Fatalf("chunk(%d, %d, %d) = %d: %d CPUs can strand %d tokens, more than burst/8 = %d",
				rate, burst, ncpu, c, ncpu, uint64(ncpu)*(c-1), burst/8)
		}
	}
}

// vclockRef is V(now) in exact arithmetic: base_v + floor(dt x rate / 1e9).
func vclockRef(p *bpf.RatelimitRlParams, now uint64) *big.Int {
	v := new(big.Int).SetUint64(p.BaseV)
	if now <= p.BaseNs {
		return v
	}
	d := new(big.Int).SetUint64(now - p.BaseNs)
	d.Mul(d, new(big.Int).SetUint64(p.Rate))
	d.Quo(d, big.NewInt(nsPerSec))
	return v.Add(v, d)
}

func TestVclock(t *testing.T) {
	const year = 365 * 24 * 3600 * uint64(nsPerSec)
	check := func(p bpf.RatelimitRlParams, now uint64) {
		t.Helper()
		want := vclockRef(&p, now)
		if !want.IsUint64() {
			t.Fatalf("test bug: V(%d) of %+v does not fit in 64 bits", now, p)
		}
		if got := vclock(&p, now); got != want.Uint64() {
			t.Fatalf("vclock(%+v, %d) = %d, want %s", p, now, got, want)
		}
	}

	// Fixed points: one second at MaxRate is MaxRate tokens; a clock behind
	// the base does not run V backwards.
	p := bpf.RatelimitRlParams{Rate: MaxRate, BaseNs: 5e9, BaseV: vOrigin}
	if got := vclock(&p, 6e9); got != vOrigin+MaxRate {
		t.Errorf("one second at MaxRate: V = %d, want %d", got, vOrigin+MaxRate)
	}
	if got := vclock(&p, 1e9); got != vOrigin {
		t.Errorf("now before base: V = %d, want base_v %d", got, uint64(vOrigin))
	}
	p = bpf.RatelimitRlParams{Rate: 3, BaseV: 7}
	if got := vclock(&p, 999_999_999); got != 7+2 { // 2.999... tokens
		t.Errorf("rate 3 after 999999999 ns: V = %d, want 9", got)
	}

	r := rand.New(rand.NewPCG(3, 4))
	for i := range 100000 {
		p := bpf.RatelimitRlParams{
			Rate:   r.Uint64N(MaxRate + 1),
			BaseNs: r.Uint64N(1 << 62),
			BaseV:  r.Uint64N(1 << 60),
		}
		if i%4 == 0 {
			p.Rate = MaxRate
		}
		var dt uint64
		switch i % 3 {
		case 0:
			dt = r.Uint64N(50 * year) // up to 50 years of uptime since the base
		case 1:
			dt = r.Uint64N(2 * nsPerSec)
		case 2:
			dt = uint64(1+r.IntN(3))*nsPerSec - uint64(r.IntN(2)) // around whole seconds
		}
		check(p, p.BaseNs+dt)
		if p.BaseNs > 0 {
			check(p, r.Uint64N(p.BaseNs)) // the clock behind the base
		}
	}
	// A century of uptime since the base, at MaxRate: V (dt x rate) stays
	// below 2^64 for 146 years at 4e9 units/s.
	check(bpf.RatelimitRlParams{Rate: MaxRate}, 100*year)
	if ^uint64(0)/MaxRate < 100*year/nsPerSec { // seconds until V reaches 2^64
		t.Errorf("MaxRate %d overflows V within a century", MaxRate)
	}
}

// wireMask turns a mask as the data path stores it (network byte order
// loaded as little-endian words) back into bytes.
func wireMask(words ...uint32) net.IPMask {
	b := make([]byte, 4*len(words))
	for i, w := range words {
		binary.LittleEndian.PutUint32(b[4*i:], w)
	}
	return b
}

func TestNetmask(t *testing.T) {
	for _, n := range []int{1, 7, 8, 9, 16, 23, 24, 31, 32} {
		if got, want := wireMask(netmask4(n)), net.CIDRMask(n, 32); got.String() != want.String() {
			t.Errorf("netmask4(%d) = %s, want %s", n, got, want)
		}
	}
	// On a little-endian host /8 is the low byte of the word.
	if got := netmask4(8); got != 0x000000ff {
		t.Errorf("netmask4(8) = %#x, want 0xff (the first byte on the wire)", got)
	}
	for _, n := range []int{1, 8, 31, 32, 33, 48, 63, 64, 65, 96, 100, 127, 128} {
		m := netmask6(n)
		if got, want := wireMask(m[:]...), net.CIDRMask(n, 128); got.String() != want.String() {
			t.Errorf("netmask6(%d) = %s, want %s", n, got, want)
		}
	}
}

func TestUnmapAll(t *testing.T) {
	tests := []struct{ in, want string }{
		{"::ffff:10.0.0.0/104", "10.0.0.0/8"},
		{"::ffff:10.1.2.3/120", "10.1.2.0/24"},
		{"::ffff:192.168.1.1/128", "192.168.1.1/32"},
		{"::ffff:0.0.0.0/96", "0.0.0.0/0"},
		{"10.1.2.3/8", "10.0.0.0/8"},
		{"2001:db8::1/32", "2001:db8::/32"},
		{"::/0", "::/0"},
	}
	in := make([]netip.Prefix, len(tests))
	for i, tt := range tests {
		in[i] = netip.MustParsePrefix(tt.in)
	}
	got := unmapAll(in)
	for i, tt := range tests {
		if got[i] != netip.MustParsePrefix(tt.want) {
			t.Errorf("unmapAll(%s) = %s, want %s", tt.in, got[i], tt.want)
		}
	}
	if got := unmapAll([]netip.Prefix{{}}); got[0].IsValid() {
		t.Errorf("unmapAll(invalid) = %s, want it to stay invalid so that Validate rejects it", got[0])
	}
}
