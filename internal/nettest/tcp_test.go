package nettest

import (
	"encoding/binary"
	"math"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/rlagent/rlagent/internal/testenv"
)

// wireFrame is the largest frame a 1500-byte MTU puts on a link (the
// counters count the Ethernet header, not the FCS).
const wireFrame = 1514

func startSink(t *testing.T, ns *NS, addr netip.AddrPort) *TCPSink {
	t.Helper()
	s, err := ns.ListenTCPSink(addr, TCPSinkConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// bulk sends size bytes from ns to dst (at most 20 s), checks that all of
// them arrive at sink, and returns the goodput in bytes per second.
func bulk(t *testing.T, ns *NS, dst netip.AddrPort, sink *TCPSink, size int64) float64 {
	t.Helper()
	before := sink.Received().Total()
	b, err := ns.StartBulk(dst, BulkConfig{Bytes: size, Duration: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Stop)
	<-b.Done()
	if err := b.Err(); err != nil {
		t.Fatal(err)
	}
	if got := b.Sent().Total(); got != size {
		t.Fatalf("sent %d of %d bytes in the 20 s bound", got, size)
	}
	if !sink.WaitReceived(before+size, 5*time.Second) {
		t.Fatalf("the sink received %d of %d bytes", sink.Received().Total()-before, size)
	}
	if got := sink.Received().Total() - before; got != size {
		t.Fatalf("the sink received %d bytes, %d sent", got, size)
	}
	return float64(size) / sink.LastArrival().Sub(b.Started()).Seconds()
}

func avg(bytes, packets uint64) float64 {
	if packets == 0 {
		return 0
	}
	return float64(bytes) / float64(packets)
}

// A bulk TCP transfer from the remote to a pod completes, every byte
// arrives, and the pod's host-side veth passes packets far above the MTU:
// the sender's GSO packets stay whole through the node (a veth has TSO and
// GSO on), so a TC program there meets multi-segment skbs. With
// segmentation off on the remote's side (MTU-sized frames, as a real wire
// carries) and GRO on the node's uplink, the uplink receives wire-sized
// frames and the pod's veth still passes packets above the MTU: GRO
// aggregated them.
func TestTCPBulkGSOAndGRO(t *testing.T) {
	testenv.RequireRoot(t)
	topo := MustTopology(t, TopologyConfig{Uplink: true, BridgePods: []string{"a"}, RoutedPods: []string{"c"}})
	const size = 64 << 20
	for _, pod := range topo.Pods() {
		t.Run("gso/"+pod.Name, func(t *testing.T) {
			families(t, func(t *testing.T, v6 bool) {
				sink := startSink(t, pod.NS, netip.AddrPortFrom(pod.Addr(v6), 5001))
				before := linkStats(t, topo.Node, pod.HostIf)
				rate := bulk(t, topo.Remote, sink.Addr(), sink, size)
				d := linkStats(t, topo.Node, pod.HostIf).Sub(before)
				t.Logf("%d MiB at %.0f MB/s; %s tx %d packets, %.0f bytes each", size>>20, rate/1e6, pod.HostIf, d.TxPackets, avg(d.TxBytes, d.TxPackets))
				if d.TxBytes < size || avg(d.TxBytes, d.TxPackets) < 2*wireFrame {
					t.Errorf("%s sent %d bytes in %d packets (%.0f each): want at least %d bytes in packets of more than %d (GSO)",
						pod.HostIf, d.TxBytes, d.TxPackets, avg(d.TxBytes, d.TxPackets), size, 2*wireFrame)
				}
			})
		})
	}
	t.Run("gro", func(t *testing.T) {
		for _, off := range []Offload{OffloadTSO, OffloadGSO} {
			if err := topo.Remote.SetOffload(UplinkIf, off, false); err != nil {
				t.Fatal(err)
			}
		}
		if err := topo.Node.SetOffload(UplinkIf, OffloadGRO, true); err != nil {
			t.Fatal(err)
		}
		pod := topo.Pod("a")
		families(t, func(t *testing.T, v6 bool) {
			sink := startSink(t, pod.NS, netip.AddrPortFrom(pod.Addr(v6), 5001))
			up, before := linkStats(t, topo.Node, UplinkIf), linkStats(t, topo.Node, pod.HostIf)
			rate := bulk(t, topo.Remote, sink.Addr(), sink, size)
			dUp, d := linkStats(t, topo.Node, UplinkIf).Sub(up), linkStats(t, topo.Node, pod.HostIf).Sub(before)
			t.Logf("%d MiB at %.0f MB/s; %s rx %d packets, %.0f bytes each; %s tx %d packets, %.0f bytes each",
				size>>20, rate/1e6, UplinkIf, dUp.RxPackets, avg(dUp.RxBytes, dUp.RxPackets), pod.HostIf, d.TxPackets, avg(d.TxBytes, d.TxPackets))
			if avg(dUp.RxBytes, dUp.RxPackets) > wireFrame {
				t.Errorf("the uplink received packets of %.0f bytes on average: the remote still sends GSO packets", avg(dUp.RxBytes, dUp.RxPackets))
			}
			if d.TxBytes < size || avg(d.TxBytes, d.TxPackets) < 2*wireFrame {
				t.Errorf("%s sent %d bytes in %d packets (%.0f each): want at least %d bytes in packets of more than %d (GRO)",
					pod.HostIf, d.TxBytes, d.TxPackets, avg(d.TxBytes, d.TxPackets), size, 2*wireFrame)
			}
		})
	})
}

// A bulk transfer through the overlay completes to a bridged and a routed
// pod; the decapsulated packets reach the pod's veth still aggregated (the
// tunnel's GSO packets are decapsulated whole).
func TestTCPBulkThroughOverlay(t *testing.T) {
	testenv.RequireRoot(t)
	topo := MustTopology(t, TopologyConfig{Uplink: true, Overlay: true, BridgePods: []string{"a"}, RoutedPods: []string{"c"}})
	const size = 32 << 20
	for _, pod := range topo.Pods() {
		t.Run(pod.Name, func(t *testing.T) {
			families(t, func(t *testing.T, v6 bool) {
				sink := startSink(t, pod.NS, netip.AddrPortFrom(pod.Addr(v6), 5001))
				up, before := linkStats(t, topo.Node, UplinkIf), linkStats(t, topo.Node, pod.HostIf)
				rate := bulk(t, topo.Remote, sink.Addr(), sink, size)
				dUp, d := linkStats(t, topo.Node, UplinkIf).Sub(up), linkStats(t, topo.Node, pod.HostIf).Sub(before)
				t.Logf("%d MiB at %.0f MB/s; %s rx %.0f bytes a packet; %s tx %d packets, %.0f bytes each",
					size>>20, rate/1e6, UplinkIf, avg(dUp.RxBytes, dUp.RxPackets), pod.HostIf, d.TxPackets, avg(d.TxBytes, d.TxPackets))
				if dUp.RxBytes < size {
					t.Errorf("the uplink received %d bytes for %d sent", dUp.RxBytes, size)
				}
				if d.TxBytes < size || avg(d.TxBytes, d.TxPackets) < 2*wireFrame {
					t.Errorf("%s sent %d bytes in %d packets (%.0f each): want at least %d bytes in packets of more than %d",
						pod.HostIf, d.TxBytes, d.TxPackets, avg(d.TxBytes, d.TxPackets), size, 2*wireFrame)
				}
			})
		})
	}
}

// synsTo counts the TCP SYNs (without ACK) to dst among the frames pc
// receives until none comes for wait (or for 10 s in all).
func synsTo(t *testing.T, pc *PacketConn, dst netip.AddrPort, wait time.Duration) int {
	t.Helper()
	n := 0
	buf := make([]byte, 65536)
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); {
		m, err := pc.Recv(buf, wait)
		if err != nil {
			t.Fatal(err)
		}
		if m == 0 {
			return n
		}
		f := buf[:m]
		if m < 14+20+20 || binary.BigEndian.Uint16(f[12:]) != 0x0800 || f[14+9] != 6 {
			continue
		}
		ip := f[14:]
		tcp := ip[int(ip[0]&0xf)*4:]
		if len(tcp) < 14 || netip.AddrFrom4([4]byte(ip[16:20])) != dst.Addr() || binary.BigEndian.Uint16(tcp[2:]) != dst.Port() {
			continue
		}
		if flags := tcp[13]; flags&0x02 != 0 && flags&0x10 == 0 {
			n++
		}
	}
	t.Fatalf("frames still arrive on the uplink after 10 s (%d SYNs to %s so far)", n, dst)
	return n
}

// The connector paces its attempts, and reports each outcome: completed
// (the sink accepted as many), refused (nothing listens), timed out (the
// SYN goes nowhere), with exactly one SYN per attempt on the wire.
func TestTCPConnector(t *testing.T) {
	testenv.RequireRoot(t)
	topo := MustTopology(t, TopologyConfig{Uplink: true, RoutedPods: []string{"c"}})
	c := topo.Pod("c")

	t.Run("completed", func(t *testing.T) {
		families(t, func(t *testing.T, v6 bool) {
			sink := startSink(t, c.NS, netip.AddrPortFrom(c.Addr(v6), 5002))
			const rate, count = 1000, 1500
			conn, err := topo.Remote.StartConnector(sink.Addr(), ConnectConfig{Rate: rate, Count: count, Duration: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Stop()
			<-conn.Done()
			f := conn.Failures()
			if got := conn.Completed().Total(); got != count || f.Total() != 0 || conn.Attempts().Total() != count {
				t.Errorf("%d attempts, %d completed, failures %+v; want %d completed", conn.Attempts().Total(), got, f, count)
			}
			from := conn.Attempts().Start().Add(200 * time.Millisecond)
			got := conn.Attempts().Rate(from, from.Add(time.Second))
			t.Logf("%d attempts at %.0f/s, all completed", count, got)
			if got < rate*0.9 || got > rate*1.1 {
				t.Errorf("attempted %.0f connections/s, want %d +-10%%", got, rate)
			}
			deadline := time.Now().Add(2 * time.Second)
			for sink.Accepted().Total() < count && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if got := sink.Accepted().Total(); got != count {
				t.Errorf("the sink accepted %d connections, %d completed", got, count)
			}
		})
	})

	t.Run("refused", func(t *testing.T) {
		conn, err := topo.Remote.StartConnector(netip.AddrPortFrom(c.Addr4, 5003), ConnectConfig{Rate: 1000, Count: 100, Duration: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		<-conn.Done()
		if f := conn.Failures(); f.Refused != 100 || conn.Completed().Total() != 0 {
			t.Errorf("%d completed, failures %+v; want 100 refused", conn.Completed().Total(), f)
		}
	})

	t.Run("timed out, one SYN each", func(t *testing.T) {
		// An address on the uplink that the remote believes is at a MAC
		// nobody has: every SYN goes on the wire and nothing answers.
		dst := netip.AddrPortFrom(nthAddr(uplink4, 99), 5004)
		mac, _ := net.ParseMAC("02:00:00:00:00:99")
		if err := topo.Remote.AddNeighbor(UplinkIf, dst.Addr(), mac); err != nil {
			t.Fatal(err)
		}
		pc, err := topo.Node.OpenPacket(UplinkIf)
		if err != nil {
			t.Fatal(err)
		}
		defer pc.Close()
		const count = 20
		start := time.Now()
		conn, err := topo.Remote.StartConnector(dst, ConnectConfig{Rate: 100, Count: count, Duration: 5 * time.Second, Timeout: 300 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		<-conn.Done()
		took := time.Since(start)
		if f := conn.Failures(); f.TimedOut != count || conn.Completed().Total() != 0 {
			t.Errorf("%d completed, failures %+v; want %d timed out", conn.Completed().Total(), f, count)
		}
		if took > 2*time.Second {
			t.Errorf("%d attempts at 100/s with a 300 ms timeout took %s", count, took)
		}
		// Past the kernel's 1 s SYN retransmission timeout: a socket still
		// open would have sent a second SYN by now.
		if got := synsTo(t, pc, dst, 1200*time.Millisecond); got != count {
			t.Errorf("%d SYNs to %s on the wire for %d attempts", got, dst, count)
		}
	})
}

// TCP through the service's DNAT: connections and a bulk transfer from the
// remote and from a pod on the same bridge reach the backend and complete
// (the SYN-ACKs come back un-DNATed).
func TestTCPThroughService(t *testing.T) {
	testenv.RequireRoot(t)
	topo := serviceTopology(t)
	b := topo.Backend
	families(t, func(t *testing.T, v6 bool) {
		sink := startSink(t, b.NS, netip.AddrPortFrom(b.Addr(v6), topo.BackendPort))
		for _, cl := range []struct {
			name string
			ns   *NS
		}{{"remote", topo.Remote}, {"bridged pod a", topo.Pod("a").NS}, {"routed pod c", topo.Pod("c").NS}} {
			accepted := sink.Accepted().Total()
			conn, err := cl.ns.StartConnector(topo.Service(v6), ConnectConfig{Rate: 1000, Count: 200, Duration: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			<-conn.Done()
			if got, f := conn.Completed().Total(), conn.Failures(); got != 200 || f.Total() != 0 {
				t.Errorf("%s: %d of 200 connections to %s completed, failures %+v", cl.name, got, topo.Service(v6), f)
			}
			deadline := time.Now().Add(2 * time.Second)
			for sink.Accepted().Total()-accepted < 200 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if got := sink.Accepted().Total() - accepted; got != 200 {
				t.Errorf("%s: the backend accepted %d connections, want 200", cl.name, got)
			}
			rate := bulk(t, cl.ns, topo.Service(v6), sink, 8<<20)
			t.Logf("%s: 8 MiB through the service at %.0f MB/s", cl.name, rate/1e6)
		}
	})
}

// A paced bulk sender writes at its rate, not as fast as the path allows,
// and the sink receives it as written.
func TestTCPBulkPaced(t *testing.T) {
	testenv.RequireRoot(t)
	topo := MustTopology(t, TopologyConfig{Uplink: true, RoutedPods: []string{"c"}})
	pod := topo.Pod("c")
	sink := startSink(t, pod.NS, netip.AddrPortFrom(pod.Addr4, 5001))
	const rate = 4 << 20 // bytes/s
	b, err := topo.Remote.StartBulk(sink.Addr(), BulkConfig{Bytes: 64 << 20, Duration: 2 * time.Second,
		WriteSize: 16 << 10, Rate: rate})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Stop()
	<-b.Done()
	if err := b.Err(); err != nil {
		t.Fatal(err)
	}
	from := b.Started().Add(500 * time.Millisecond)
	to := from.Add(time.Second)
	sent := b.Sent().Rate(from, to)
	// Out of time, the sender reset the connection: what it wrote by to,
	// half a second before, has arrived; the last writes may not have.
	if want := b.Sent().Count(b.Started(), to); !sink.WaitReceived(want, 5*time.Second) {
		t.Fatalf("the sink got %d bytes; %d were written by the end of the window", sink.Received().Total(), want)
	}
	got := sink.Received().Rate(from, to)
	t.Logf("paced at %d B/s: wrote %.0f B/s, the sink received %.0f B/s", rate, sent, got)
	if math.Abs(sent-rate) > 0.05*rate {
		t.Errorf("the sender wrote %.0f B/s, want %d +-5%%", sent, rate)
	}
	if math.Abs(got-sent) > 0.05*sent {
		t.Errorf("the sink received %.0f B/s of the %.0f written", got, sent)
	}
}
