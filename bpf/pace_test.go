package bpf_test

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/rlagent/rlagent/maps"
)

// Action pace (tc_uplink_out, the one hook it is valid at): a packet's
// departure (skb->tstamp out of BPF_PROG_TEST_RUN) is when its tokens
// accrue on the limit's bucket. The test clock is the paced limits' clock
// too, so the departures are exact numbers.

// stamp is a packet's departure as a TC program left it. (test_run
// neither takes nor reports __sk_buff.tstamp_type.)
type stamp struct {
	verdict uint32 // xdpPass or xdpDrop
	tstamp  uint64
}

// runStamped runs TC program p on pkt with an __sk_buff whose tstamp is
// in, and returns the verdict and the tstamp out.
func (p prog) runStamped(tb testing.TB, d *maps.Datapath, pkt []byte, in uint64) stamp {
	tb.Helper()
	layout, err := skbLayout()
	if err != nil {
		tb.Fatal(err)
	}
	ctx := skbCtx(tb, nil)
	ts := layout["tstamp"]
	if ts.size != 8 {
		tb.Fatalf("__sk_buff.tstamp is %d bytes, want 8", ts.size)
	}
	binary.NativeEndian.PutUint64(ctx[ts.off:], in)
	out := make([]byte, len(ctx))
	ret, err := p.of(tb, d).Run(&ebpf.RunOptions{Data: pkt, Context: ctx, ContextOut: out})
	if err != nil {
		tb.Fatalf("run %s: %v", p.name, err)
	}
	return stamp{p.verdict(tb, ret), binary.NativeEndian.Uint64(out[ts.off:])}
}

// paced is perSecond(rate, burst) with action pace and horizon h, at the
// uplinks' egress.
func paced(rate, burst uint64, h time.Duration) maps.Limit {
	l := perSecond(rate, burst)
	l.Action = maps.Pace
	l.Horizon = h
	l.Match.Direction = maps.Egress
	return l
}

// The burst leaves unstamped; then departures one cost/rate apart, exactly,
// until the horizon: the packet that would wait past it is dropped and
// reserves nothing (the next one still gets the departure after the last
// admitted); time moving on shortens the wait by as much.
func TestPaceDepartures(t *testing.T) {
	const (
		rate, burst = 1000, 10
		gap         = uint64(time.Second / rate) // ns between departures
		horizon     = 100 * time.Millisecond
		start       = uint64(1e9)
	)
	d := hookDatapath(t)
	fresh(t, d, 0, paced(rate, burst, horizon))
	p := udp4("10.0.0.1", "10.0.0.2", 53)
	for i := range burst {
		if s := tcEgress.runStamped(t, d, p, 0); s.verdict != xdpPass || s.tstamp != 0 {
			t.Fatalf("burst packet %d: verdict %d, tstamp %d; want pass, unstamped", i, s.verdict, s.tstamp)
		}
	}
	// horizon / gap packets wait 1..100 ms.
	n := uint64(horizon) / gap
	var sum uint64
	for k := uint64(1); k <= n; k++ {
		s := tcEgress.runStamped(t, d, p, 0)
		if want := start + k*gap; s.verdict != xdpPass || s.tstamp != want {
			t.Fatalf("packet %d after the burst: verdict %d, tstamp %d; want pass at %d", k, s.verdict, s.tstamp, want)
		}
		sum += k * gap
	}
	for range 3 {
		if s := tcEgress.runStamped(t, d, p, 0); s.verdict != xdpDrop {
			t.Fatalf("a packet past the horizon: verdict %d, tstamp %d; want a drop", s.verdict, s.tstamp)
		}
	}
	st := mustStats(t, d, 0)
	if st.AdmittedPackets != burst+n || st.PacedPackets != n || st.HorizonDrops != 3 || st.DroppedPackets != 3 {
		t.Errorf("stats %+v: want %d admitted, %d paced, 3 dropped past the horizon", st, burst+n, n)
	}
	if st.PacedDelayNs != sum || st.PacedDelayMaxNs != uint64(horizon) {
		t.Errorf("delay %d ns in all, %d at most; want %d, %d", st.PacedDelayNs, st.PacedDelayMaxNs, sum, uint64(horizon))
	}
	// 30 ms later the next departure is the one after the last admitted.
	setClock(t, d, start+30e6, 0)
	if s := tcEgress.runStamped(t, d, p, 0); s.verdict != xdpPass || s.tstamp != start+(n+1)*gap {
		t.Errorf("30 ms on: verdict %d, tstamp %d; want pass at %d", s.verdict, s.tstamp, start+(n+1)*gap)
	}
}

// A stamp set earlier than the limit's departure is moved to it; one later
// than it (a TCP socket's own pacing) is kept.
func TestPaceKeepsLaterStamp(t *testing.T) {
	const rate, burst = 1000, 1
	d := hookDatapath(t)
	fresh(t, d, 0, paced(rate, burst, 100*time.Millisecond))
	p := udp4("10.0.0.1", "10.0.0.2", 53)
	if s := tcEgress.runStamped(t, d, p, 0); s.verdict != xdpPass || s.tstamp != 0 {
		t.Fatalf("the burst: verdict %d, tstamp %d", s.verdict, s.tstamp)
	}
	for _, c := range []struct {
		name     string
		in, want uint64
	}{
		{"earlier stamp", 1e9 + 1, 1e9 + 1e6},
		{"later stamp", 1e9 + 50e6, 1e9 + 50e6},
		{"no stamp", 0, 1e9 + 3e6}, // the kept one reserved its tokens all the same
	} {
		s := tcEgress.runStamped(t, d, p, c.in)
		if s.verdict != xdpPass || s.tstamp != c.want {
			t.Errorf("%s %d: verdict %d, tstamp %d; want pass at %d", c.name, c.in, s.verdict, s.tstamp, c.want)
		}
	}
}

// Departures are exact however the packets spread over CPUs: every paced
// packet reserves from the one pool, none from a CPU's cache. Packets
// alternate over the CPUs one by one; the clock stands still, so packet k
// after the burst leaves at k x gap.
func TestPaceAcrossCPUs(t *testing.T) {
	const (
		rate, burst = 10_000, 5
		gap         = uint64(time.Second / rate)
		start       = uint64(1e9)
		after       = 400 // packets after the burst
	)
	n := ncpu(t)
	d := hookDatapath(t)
	fresh(t, d, 0, paced(rate, burst, 100*time.Millisecond))
	p := udp4("10.0.0.1", "10.0.0.2", 53)
	for i := range burst + after {
		unpin := pinCPU(t, i%n)
		s := tcEgress.runStamped(t, d, p, 0)
		unpin()
		want := uint64(0)
		if i >= burst {
			want = start + uint64(i-burst+1)*gap
		}
		if s.verdict != xdpPass || s.tstamp != want {
			t.Fatalf("packet %d on CPU %d: verdict %d, tstamp %d; want pass at %d", i, i%n, s.verdict, s.tstamp, want)
		}
	}
	if st := mustStats(t, d, 0); st.AdmittedPackets != burst+after || st.PacedPackets != after {
		t.Errorf("stats %+v: want %d admitted, %d paced", st, burst+after, after)
	}
}

// A bytes limit spaces departures by each packet's length, a keyed limit
// keeps a departure line per key, and a connections limit paces SYNs and
// leaves the connection's other packets alone.
func TestPaceUnitsAndKeys(t *testing.T) {
	const start = uint64(1e9)
	p53 := udp4("10.0.0.1", "10.0.0.2", 53)
	t.Run("bytes", func(t *testing.T) {
		d := hookDatapath(t)
		l := paced(uint64(len(p53))*1000, uint64(len(p53)), 100*time.Millisecond)
		l.Unit = maps.Bytes
		fresh(t, d, 0, l)
		big := pkt{src: "10.0.0.1", dst: "10.0.0.2", proto: protoUDP, sport: 40000, dport: 53, payload: 3 * len(p53)}.bytes()
		// len(p53) bytes/ms: the burst is the first small packet; the big
		// one waits for its len(big) bytes, the small one after it for
		// one more ms.
		wantAt := []uint64{0, start + uint64(len(big))*1e6/uint64(len(p53)), start + uint64(len(big)+len(p53))*1e6/uint64(len(p53))}
		for i, frame := range [][]byte{p53, big, p53} {
			if s := tcEgress.runStamped(t, d, frame, 0); s.verdict != xdpPass || s.tstamp != wantAt[i] {
				t.Errorf("packet %d (%d bytes): verdict %d, tstamp %d; want pass at %d", i, len(frame), s.verdict, s.tstamp, wantAt[i])
			}
		}
	})
	t.Run("dst-ip", func(t *testing.T) {
		d := hookDatapath(t)
		l := paced(1000, 1, 100*time.Millisecond)
		l.Key = maps.KeyDstIP
		fresh(t, d, 0, l)
		a, b := udp4("10.0.0.1", "10.0.0.2", 53), udp4("10.0.0.1", "10.0.0.3", 53)
		for i, c := range []struct {
			frame []byte
			want  uint64
		}{{a, 0}, {a, start + 1e6}, {b, 0}, {a, start + 2e6}, {b, start + 1e6}} {
			if s := tcEgress.runStamped(t, d, c.frame, 0); s.verdict != xdpPass || s.tstamp != c.want {
				t.Errorf("packet %d: verdict %d, tstamp %d; want pass at %d", i, s.verdict, s.tstamp, c.want)
			}
		}
	})
	t.Run("connections", func(t *testing.T) {
		d := hookDatapath(t)
		l := paced(1000, 1, 100*time.Millisecond)
		l.Unit = maps.Connections
		l.Match.Protocol, l.Match.DstPorts = maps.TCP, ports(443)
		fresh(t, d, 0, l)
		syn := pkt{src: "10.0.0.1", dst: "10.0.0.2", proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpSYN}.bytes()
		ack := pkt{src: "10.0.0.1", dst: "10.0.0.2", proto: protoTCP, sport: 40000, dport: 443, tcpFlags: tcpACK, payload: 100}.bytes()
		for i, c := range []struct {
			frame []byte
			want  uint64
		}{{syn, 0}, {ack, 0}, {syn, start + 1e6}, {ack, 0}, {ack, 0}, {syn, start + 2e6}} {
			if s := tcEgress.runStamped(t, d, c.frame, 0); s.verdict != xdpPass || s.tstamp != c.want {
				t.Errorf("packet %d: verdict %d, tstamp %d; want pass at %d", i, s.verdict, s.tstamp, c.want)
			}
		}
		if st := mustStats(t, d, 0); st.AdmittedPackets != 3 || st.PacedPackets != 2 {
			t.Errorf("stats %+v: want the 3 SYNs admitted, 2 of them paced, no ACK counted", st)
		}
	})
}

// All or nothing with a paced limit: a packet that another limit drops
// gives its reservation back, so the next packet gets the departure it
// would have had; a packet that matches two paced limits leaves at the
// later of their departures, and draws from both.
func TestPaceAllOrNothing(t *testing.T) {
	const start = uint64(1e9)
	p := udp4("10.0.0.1", "10.0.0.2", 53)
	d := hookDatapath(t)
	fresh(t, d, 0, paced(1000, 1, 100*time.Millisecond))
	// Limit 1: every UDP packet at the same hook, drop, rate 10/s, burst 3.
	other := maps.Limit{Rate: 10, Burst: 3, Match: maps.Match{Direction: maps.Egress, Protocol: maps.UDP}}
	mustSet(t, d, 1, other)
	for i, want := range []stamp{{xdpPass, 0}, {xdpPass, start + 1e6}, {xdpPass, start + 2e6}, {xdpDrop, 0}, {xdpDrop, 0}} {
		if s := tcEgress.runStamped(t, d, p, 0); s != want {
			t.Errorf("packet %d: %+v, want %+v", i, s, want)
		}
	}
	// Without the drop limit, the paced limit's next departure is as if
	// the two dropped packets had never come: 3 ms, not 5.
	if err := d.DeleteLimit(1); err != nil {
		t.Fatal(err)
	}
	if s := tcEgress.runStamped(t, d, p, 0); s.verdict != xdpPass || s.tstamp != start+3e6 {
		t.Errorf("after the drops: %+v, want a pass at %d", s, start+3e6)
	}
	if st := mustStats(t, d, 0); st.AdmittedPackets != 4 || st.DroppedPackets != 0 {
		t.Errorf("paced limit: %+v, want 4 admitted and none of the other limit's drops", st)
	}

	// Two paced limits: 1000/s and 500/s; the packet leaves at the later.
	fresh(t, d, 0, paced(1000, 1, 100*time.Millisecond))
	slow := paced(500, 1, 100*time.Millisecond)
	slow.Match.DstPorts = nil
	mustSet(t, d, 1, slow)
	for i, want := range []uint64{0, start + 2e6, start + 4e6} {
		if s := tcEgress.runStamped(t, d, p, 0); s.verdict != xdpPass || s.tstamp != want {
			t.Errorf("packet %d of two paced limits: %+v, want a pass at %d", i, s, want)
		}
	}
}
