package attach

import (
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/rlagent/rlagent/internal/nettest"
)

// rootQdisc is the kind of the root qdisc of ifname in ns.
func rootQdisc(t *testing.T, ns *nettest.NS, ifname string) string {
	t.Helper()
	var kind string
	if err := ns.Do(func() error {
		_, root, _, err := qdiscs(ifname)
		if root != nil {
			kind = root.Type()
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return kind
}

// An interface whose qdisc is not fq does not pace, and the state says
// what it has instead; a qdisc someone configured is never replaced; the
// kernel's default is, by fq with the parameters asked for (where the
// kernel has sch_fq: make vmtest's VMs do, the host of make test does
// not, and then EnsureFQ says which module is missing), and RemoveFQ puts
// the default back.
func TestFQ(t *testing.T) {
	p := pair(t, "10.93.0.0/30")
	const dev = "veth-a"
	in := func(fn func() error) {
		t.Helper()
		if err := p.A.Do(fn); err != nil {
			t.Fatal(err)
		}
	}
	want := FQ{Horizon: 150 * time.Millisecond, FlowLimit: 4000}

	// A veth's default: noqueue.
	in(func() error {
		st, err := CheckFQ(dev)
		if err != nil {
			return err
		}
		if st.Paces || !strings.Contains(st.Why, "root qdisc is noqueue, not fq") {
			t.Errorf("noqueue: %+v, want not pacing, saying noqueue", st)
		}
		return nil
	})

	// An operator's htb: checked, not replaced.
	in(func() error {
		l, err := netlink.LinkByName(dev)
		if err != nil {
			return err
		}
		htb := netlink.NewHtb(netlink.QdiscAttrs{LinkIndex: l.Attrs().Index, Parent: netlink.HANDLE_ROOT, Handle: netlink.MakeHandle(1, 0)})
		if err := netlink.QdiscReplace(htb); err != nil {
			return err
		}
		st, err := EnsureFQ(dev, want)
		if err != nil {
			return err
		}
		if st.Paces || !strings.Contains(st.Why, "root qdisc is htb, which someone configured") {
			t.Errorf("htb: %+v, want not pacing, saying htb is someone's", st)
		}
		if removed, err := RemoveFQ(dev); removed || err != nil {
			t.Errorf("RemoveFQ on htb = %v, %v; want false, nil", removed, err)
		}
		return netlink.QdiscDel(htb)
	})
	if k := rootQdisc(t, p.A, dev); k != "noqueue" {
		t.Fatalf("after the htb test the root qdisc is %q, want noqueue back", k)
	}

	// mq with the default pfifo_fast child: not pacing, and named.
	in(func() error {
		l, err := netlink.LinkByName(dev)
		if err != nil {
			return err
		}
		mq := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index, Parent: netlink.HANDLE_ROOT,
			Handle: netlink.MakeHandle(0x8100, 0)}, QdiscType: "mq"}
		if err := netlink.QdiscReplace(mq); err != nil {
			return err
		}
		st, err := CheckFQ(dev)
		if err != nil {
			return err
		}
		if st.Paces || !strings.Contains(st.Why, "root qdisc mq has a pfifo_fast child (queue 1), not fq") {
			t.Errorf("mq: %+v, want not pacing, naming the pfifo_fast child", st)
		}
		return netlink.QdiscDel(mq)
	})

	// The default replaced by fq, and back.
	in(func() error {
		st, err := EnsureFQ(dev, want)
		if err != nil {
			if !strings.Contains(err.Error(), "load the module sch_fq") {
				t.Errorf("EnsureFQ on a kernel without fq: %v, want it to name the module sch_fq", err)
			}
			t.Logf("this kernel has no fq: %v", err)
			return nil
		}
		if !st.Paces || !st.Ours {
			t.Errorf("EnsureFQ: %+v, want our fq", st)
		}
		_, root, _, err := qdiscs(dev)
		if err != nil {
			return err
		}
		fq, ok := root.(*netlink.Fq)
		if !ok || fq.Horizon != 150000 || fq.FlowPacketLimit != 4000 || fq.PacketLimit != 10000 {
			t.Errorf("root qdisc %v, want fq with horizon 150000 us, flow limit 4000, limit 10000", root)
		}
		if again, err := EnsureFQ(dev, want); err != nil || again != st {
			t.Errorf("EnsureFQ again: %+v, %v; want %+v", again, err, st)
		}
		removed, err := RemoveFQ(dev)
		if !removed || err != nil {
			t.Errorf("RemoveFQ = %v, %v; want true", removed, err)
		}
		return nil
	})
	if k := rootQdisc(t, p.A, dev); k != "noqueue" {
		t.Errorf("at the end the root qdisc is %q, want noqueue", k)
	}
}
