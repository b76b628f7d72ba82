package nettest

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/internal/testenv"
)

func TestMain(m *testing.M) {
	MaybeExec()
	os.Exit(m.Run())
}

// nsInode identifies a network namespace.
func nsInode(t *testing.T, fd int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func TestPairReachesBothWays(t *testing.T) {
	testenv.RequireRoot(t)
	p := MustPair(t, PairConfig{Subnet4: netip.MustParsePrefix("10.201.7.0/24"), Subnet6: netip.MustParsePrefix("fd00:201:7::/64")})
	if p.A4.String() != "10.201.7.1" || p.B4.String() != "10.201.7.2" || p.B6.String() != "fd00:201:7::2" {
		t.Fatalf("addresses A4 %s B4 %s B6 %s", p.A4, p.B4, p.B6)
	}
	for _, tc := range []struct {
		network  string
		from, to *NS
		dst      netip.Addr
	}{
		{"udp4", p.A, p.B, p.B4},
		{"udp6", p.A, p.B, p.B6},
		{"udp4", p.B, p.A, p.A4},
		{"udp6", p.B, p.A, p.A6},
	} {
		t.Run(tc.network+"-"+tc.from.Name+"-"+tc.to.Name, func(t *testing.T) {
			dst := netip.AddrPortFrom(tc.dst, 5300)
			rc, err := tc.to.ListenUDP(tc.network, dst, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			defer rc.Close()
			sc, err := tc.from.DialUDP(dst)
			if err != nil {
				t.Fatal(err)
			}
			defer sc.Close()
			if _, err := sc.Write([]byte("hello")); err != nil {
				t.Fatal(err)
			}
			rc.SetReadDeadline(time.Now().Add(2 * time.Second))
			buf := make([]byte, 64)
			n, from, err := rc.ReadFromUDPAddrPort(buf)
			if err != nil {
				t.Fatalf("nothing received: %v", err)
			}
			if string(buf[:n]) != "hello" {
				t.Errorf("got %q", buf[:n])
			}
			if want := map[*NS]netip.Addr{p.A: p.A4, p.B: p.B4}[tc.from]; tc.network == "udp4" && from.Addr() != want {
				t.Errorf("from %s, want %s", from.Addr(), want)
			}
		})
	}
}

func TestDoRunsInTheNamespaceAndComesBack(t *testing.T) {
	testenv.RequireRoot(t)
	ns, err := NewNS("x")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	self, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	host := nsInode(t, int(self.Fd()))
	self.Close()
	var inside uint64
	if err := ns.Do(func() error {
		f, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			return err
		}
		defer f.Close()
		inside = nsInode(t, int(f.Fd()))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if want := nsInode(t, int(ns.Handle())); inside != want || inside == host {
		t.Errorf("Do ran in namespace %d; want %d (host %d)", inside, want, host)
	}
}

// TestHoldSitsInTheNamespace: a holder is a process in the namespace, as a
// pod's pause container is, until the test that started it ends.
func TestHoldSitsInTheNamespace(t *testing.T) {
	testenv.RequireRoot(t)
	ns, err := NewNS("hold")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	var pid int
	t.Run("held", func(t *testing.T) {
		pid = ns.Hold(t)
		got, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", pid))
		if err != nil {
			t.Fatal(err)
		}
		if want := fmt.Sprintf("net:[%d]", nsInode(t, int(ns.Handle()))); got != want {
			t.Errorf("the holder (pid %d) is in %s, want %s", pid, got, want)
		}
		if got, _ := os.Readlink("/proc/self/ns/net"); got == fmt.Sprintf("net:[%d]", nsInode(t, int(ns.Handle()))) {
			t.Error("the test process itself moved into the namespace")
		}
	})
	// The subtest's Cleanup ended and reaped it.
	if err := unix.Kill(pid, 0); !errors.Is(err, unix.ESRCH) {
		t.Errorf("the holder (pid %d) is still there after its test ended: kill 0 = %v", pid, err)
	}
}

// TestStartRunsTheProgramInTheNamespace starts this test binary through the
// launcher and has it print the namespace it runs in.
func TestStartRunsTheProgramInTheNamespace(t *testing.T) {
	if os.Getenv("NETTEST_HELPER") == "1" {
		b, err := os.Readlink("/proc/self/ns/net")
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("NS=%s PID=%d\n", b, os.Getpid())
		return
	}
	testenv.RequireRoot(t)
	ns := launchNS(t, "launch")
	out, pid := runSelf(t, "TestStartRunsTheProgramInTheNamespace", "1", ns.Start)
	want := fmt.Sprintf("NS=net:[%d] PID=%d", nsInode(t, int(ns.Handle())), pid)
	if !strings.Contains(out, want) {
		t.Errorf("output %q, want a line %q", out, want)
	}
}

// launchNS is a namespace for the launcher's tests, closed at the end.
func launchNS(t *testing.T, name string) *NS {
	t.Helper()
	ns, err := NewNS(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	return ns
}

// runSelf runs this binary's test named test with NETTEST_HELPER=helper,
// started by start (NS.Start, NS.StartIPNetnsExec), and returns its output
// and PID once it has exited.
func runSelf(t *testing.T, test, helper string, start func(*exec.Cmd) error) (string, int) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^"+test+"$")
	cmd.Env = append(os.Environ(), "NETTEST_HELPER="+helper)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := start(cmd); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	return out.String(), cmd.Process.Pid
}

// TestStartIPNetnsExecLeavesTheCallerAlone: a program started as `ip netns
// exec` starts one runs in the namespace, in a mount namespace of its own
// with the namespace's sysfs on /sys and none of the caller's mounts under
// it; and no thread of the caller is left in another mount or network
// namespace, however many are started (a thread left in the program's
// mount namespace would keep it, and a bpffs mounted in it, alive: a
// killed agent's pins and XDP link with them).
func TestStartIPNetnsExecLeavesTheCallerAlone(t *testing.T) {
	if os.Getenv("NETTEST_HELPER") == "mounts" {
		mnt, err1 := os.Readlink("/proc/self/ns/mnt")
		net, err2 := os.Readlink("/proc/self/ns/net")
		info, err3 := os.ReadFile("/proc/self/mountinfo")
		if err := errors.Join(err1, err2, err3); err != nil {
			t.Fatal(err)
		}
		fmt.Printf("NET=%s MNT=%s\n", net, mnt)
		for line := range strings.SplitSeq(string(info), "\n") {
			// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [TAGS...] - FSTYPE SOURCE SUPER
			f := strings.Fields(line)
			sep := slices.Index(f, "-")
			if len(f) > 4 && sep > 0 && sep+2 < len(f) && (f[4] == "/sys" || strings.HasPrefix(f[4], "/sys/")) {
				fmt.Printf("MOUNT %s %s %s\n", f[4], f[sep+1], f[sep+2])
			}
		}
		return
	}
	testenv.RequireRoot(t)
	ns := launchNS(t, "ipnetnsexec")
	ownMnt, err1 := os.Readlink("/proc/self/ns/mnt")
	ownNet, err2 := os.Readlink("/proc/self/ns/net")
	if err := errors.Join(err1, err2); err != nil {
		t.Fatal(err)
	}
	wantNet := fmt.Sprintf("NET=net:[%d] ", nsInode(t, int(ns.Handle())))

	const runs = 50 // the old way in the test process left its main thread behind in 1 of 200 or fewer
	for i := range runs {
		got, _ := runSelf(t, "TestStartIPNetnsExecLeavesTheCallerAlone", "mounts", ns.StartIPNetnsExec)
		if i > 0 {
			continue
		}
		t.Logf("the program's view:\n%s", got)
		if !strings.Contains(got, wantNet) {
			t.Errorf("the program is not in %s: want %q", ns.Name, wantNet)
		}
		if strings.Contains(got, "MNT="+ownMnt+"\n") {
			t.Errorf("the program runs in the caller's mount namespace %s", ownMnt)
		}
		var sys []string
		for line := range strings.SplitSeq(got, "\n") {
			if rest, ok := strings.CutPrefix(line, "MOUNT "); ok {
				sys = append(sys, rest)
			}
		}
		if want := []string{"/sys sysfs " + ns.Name}; !slices.Equal(sys, want) {
			t.Errorf("the program's mounts at and under /sys: %q, want %q (a fresh sysfs, none of the caller's)", sys, want)
		}
	}

	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		dir := "/proc/self/task/" + task.Name()
		mnt, err1 := os.Readlink(dir + "/ns/mnt")
		net, err2 := os.Readlink(dir + "/ns/net")
		if errors.Join(err1, err2) != nil {
			continue // the thread ended meanwhile
		}
		if mnt != ownMnt || net != ownNet {
			t.Errorf("after %d programs started, thread %s is in %s and %s, want the process's %s and %s",
				runs, task.Name(), mnt, net, ownMnt, ownNet)
		}
	}
}

func TestSenderPacesAndReceiverCounts(t *testing.T) {
	testenv.RequireRoot(t)
	p := MustPair(t, PairConfig{})
	dst := netip.AddrPortFrom(p.B4, 5300)
	rc, err := p.B.ListenUDP("udp4", dst, 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	r := StartReceiver(rc, ReceiverConfig{Span: 10 * time.Second})
	defer r.Close()
	sc, err := p.A.DialUDP(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()

	const rate = 5000
	s, err := StartSender(sc, SenderConfig{Rate: rate, Count: 1e6, Duration: 1500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	<-s.Done() // the duration bound stops it
	time.Sleep(100 * time.Millisecond)
	from := s.Sent().Start().Add(200 * time.Millisecond)
	to := from.Add(time.Second)
	if got := s.Sent().Rate(from, to); got < rate*0.95 || got > rate*1.05 {
		t.Errorf("offered %.0f pkt/s, want %d +-5%%", got, rate)
	}
	if sent, got := s.Sent().Total(), r.Got().Total(); got != sent {
		nerr, err := s.Errors()
		t.Errorf("received %d of %d sent (write errors %d: %v)", got, sent, nerr, err)
	}
	if sent, got := s.Sent().Count(from, to), r.Got().Count(from, to); sent != got {
		t.Errorf("the same window counts %d sent and %d received", sent, got)
	}
	if total := s.Sent().Total(); total < rate*1.3 || total > rate*1.6 {
		t.Errorf("sent %d in 1.5 s at %d pkt/s", total, rate)
	}
	st, err := p.B.UDPStats()
	if err != nil {
		t.Fatal(err)
	}
	if st.InDatagrams != uint64(r.Got().Total()) || st.RcvbufErrors != 0 {
		t.Errorf("namespace UDP stats %+v; the receiver got %d", st, r.Got().Total())
	}

	// The count bound stops it too, and SetRate applies.
	s, err = StartSender(sc, SenderConfig{Rate: 100, Count: 300, Duration: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	s.SetRate(20000)
	select {
	case <-s.Done():
	case <-time.After(2 * time.Second):
		s.Stop()
		t.Fatalf("a sender bounded to 300 packets at 20000 pkt/s still runs after 2 s (sent %d)", s.Sent().Total())
	}
	if got := s.Sent().Total(); got != 300 {
		t.Errorf("sent %d, want the bound of 300", got)
	}
}

func TestBinsCutWindowsAtBinBoundaries(t *testing.T) {
	t0 := time.Unix(1000, 0)
	b := newBins(t0, 10*time.Millisecond, time.Second)
	for i := range 100 {
		b.add(t0.Add(time.Duration(i)*10*time.Millisecond+time.Millisecond), int64(i))
	}
	b.add(t0.Add(-time.Millisecond), 7)
	b.add(t0.Add(2*time.Second), 5)
	if got := b.Count(t0, t0.Add(30*time.Millisecond)); got != 0+1+2 {
		t.Errorf("Count of the first 3 bins = %d", got)
	}
	if got := b.Count(t0.Add(15*time.Millisecond), t0.Add(35*time.Millisecond)); got != 1+2 {
		t.Errorf("Count rounded down = %d, want bins 1 and 2", got)
	}
	if got := b.Rate(t0, t0.Add(20*time.Millisecond)); got != 50 {
		t.Errorf("Rate = %v, want 0+1 per 20 ms = 50/s", got)
	}
	if got := b.Series(t0, t0.Add(55*time.Millisecond), 20*time.Millisecond); len(got) != 2 || got[0] != 1 || got[1] != 5 {
		t.Errorf("Series = %v, want [1 5]", got)
	}
	if b.Outside() != 12 || b.Total() != 4950+12 {
		t.Errorf("outside %d total %d", b.Outside(), b.Total())
	}
}
