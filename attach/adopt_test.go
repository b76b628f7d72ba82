package attach

import (
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/internal/bpftest"
	"github.com/rlagent/rlagent/internal/nettest"
)

// A second Attacher on the same pin directory (a restarted agent) adopts
// the first one's attachment while packets flow: the program is swapped in
// place, and every packet is counted by the old program or the new one,
// none by both and none by neither. The reference is a counter on the
// sender's egress, which nothing touches meanwhile.
func TestAdoptionWithoutGap(t *testing.T) {
	for _, tc := range []struct {
		name   string
		clsact bool
		subnet string
	}{
		{"tcx", false, "10.220.5.0/24"},
		{"clsact", true, "10.220.6.0/24"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pair(t, tc.subnet)
			first := newAttacher(t, Options{ForceClsact: tc.clsact})
			in := Point{Iface: "veth-b", Netns: nsPath(p.B), Kind: TCIngress}
			old := bpftest.NewCounter(t, ebpf.SchedCLS, "test_old", bpftest.TCXNext)
			before := mustAttach(t, first, in, old.Prog)

			refA := newAttacher(t, Options{})
			ref := bpftest.NewCounter(t, ebpf.SchedCLS, "test_ref", bpftest.TCXNext)
			mustAttach(t, refA, Point{Iface: "veth-a", Netns: nsPath(p.A), Kind: TCEgress}, ref.Prog)

			dst := netip.AddrPortFrom(p.B4, 7004)
			rc, err := p.B.ListenUDP("udp4", dst, 8<<20)
			if err != nil {
				t.Fatal(err)
			}
			defer rc.Close()
			sc, err := p.A.DialUDP(dst)
			if err != nil {
				t.Fatal(err)
			}
			defer sc.Close()
			// 50 packets a millisecond, back to back: a gap of a few
			// microseconds at the swap would miss some.
			s, err := nettest.StartSender(sc, nettest.SenderConfig{Rate: 50000, Count: 40000, Duration: 3 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Stop()
			time.Sleep(300 * time.Millisecond)

			second := New(Options{PinDir: first.pinDir, ForceClsact: tc.clsact, Log: testLogger(t)})
			adopted := bpftest.NewCounter(t, ebpf.SchedCLS, "test_new", bpftest.TCXNext)
			res := mustAttach(t, second, in, adopted.Prog)
			if res.Change != Replaced || res.Program != adopted.ID(t) {
				t.Fatalf("the second Attacher: %+v, want the attachment replaced, running %d", res, adopted.ID(t))
			}
			if tc.clsact {
				fs := bpftest.BPFFilters(t, p.B, "veth-b", netlink.HANDLE_MIN_INGRESS)
				if len(fs) != 1 || fs[0].Id != int(adopted.ID(t)) {
					t.Fatalf("after adoption the hook has filters %+v, want one running %d", fs, adopted.ID(t))
				}
			} else if res.Link != before.Link {
				t.Fatalf("adoption made link %d, want the pinned link %d updated", res.Link, before.Link)
			}
			<-s.Done()
			sent := s.Sent().Total()
			if n, err := s.Errors(); n > 0 {
				t.Fatalf("%d sends failed: %v", n, err)
			}

			want := uint64(sent)
			deadline := time.Now().Add(time.Second)
			for ref.N(t) < want || old.N(t)+adopted.N(t) < ref.N(t) {
				if time.Now().After(deadline) {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			r, o, a := ref.N(t), old.N(t), adopted.N(t)
			t.Logf("sent %d; reference %d; old program %d, new program %d", sent, r, o, a)
			if r != want {
				t.Fatalf("the reference counted %d of %d packets sent", r, want)
			}
			if o == 0 || a == 0 {
				t.Fatalf("old %d, new %d: the swap did not happen while packets flowed", o, a)
			}
			if o+a != r {
				t.Errorf("old %d + new %d = %d, want %d: %d packets passed the hook unseen or seen twice",
					o, a, o+a, r, int64(r)-int64(o+a))
			}
		})
	}
}
