// Command demo shows rlagent dividing a global rate limit among replicas, on
// real packets: `make demo` (as root).
//
// It creates two network namespaces joined by a veth pair, runs `rlagent run`
// on one end with a global limit of 20,000 pkt/s on UDP port 53 and a count
// file as the replica count, floods UDP/53 from the other end at 40,000 pkt/s
// with a bounded, paced sender, and prints once a second what the agent
// reports and what a socket behind it received, while the count file goes
// 1 -> 2 -> 4 -> 1, -phase (10 s) each. It stops by itself after the last
// phase, or on Ctrl-C, and removes everything it created: the agent process,
// the pins (`rlagent cleanup`), the private bpffs, the namespaces and its
// temporary files.
//
// Its verdict is its exit status: 1 when a count's mean admitted rate (the
// phase's seconds after the first line whose status shows its share) is off
// its share, global / count, by more than -tolerance percent, or status
// reports another share; stderr names the count. `make test` runs it with 3 s
// phases at the end-to-end tests' rates (TestDemo).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/agent"
	"github.com/rlagent/rlagent/internal/nettest"
)

const (
	limitName = "dns"
	port      = 53
)

type options struct {
	rlagent   string
	rate      uint64
	offered   float64
	phase     time.Duration
	counts    []int
	tolerance float64 // percent of the share
}

func main() {
	nettest.MaybeExec() // the launcher of the agent in its namespace: never returns there

	var o options
	var counts string
	flag.StringVar(&o.rlagent, "rlagent", "bin/rlagent", "the rlagent binary")
	flag.Uint64Var(&o.rate, "rate", 20000, "the limit's global rate, packets per second")
	flag.Float64Var(&o.offered, "offered", 40000, "the rate the client offers, packets per second")
	flag.DurationVar(&o.phase, "phase", 10*time.Second, "how long each count lasts")
	flag.StringVar(&counts, "counts", "1,2,4,1", "the replica counts, in order")
	flag.Float64Var(&o.tolerance, "tolerance", 5, "how far each count's mean admitted rate may be off its share, in percent, before the demo fails")
	flag.Parse()
	// The first second of a phase is not measured: the new count applies
	// within it.
	if o.phase < 2*time.Second {
		fmt.Fprintf(os.Stderr, "demo: -phase %v: want at least 2s (a second to apply the count, one to measure it)\n", o.phase)
		os.Exit(2)
	}
	for f := range strings.SplitSeq(counts, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "demo: -counts: %q is not a count of 1 or more\n", f)
			os.Exit(2)
		}
		o.counts = append(o.counts, n)
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "demo: needs root (it creates network namespaces and loads BPF): run it with sudo, e.g. sudo make demo")
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// Output piped into a reader that quits (| head) must not kill the demo
	// before it cleans up: with SIGPIPE notified, a write fails instead.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	d := &demo{opts: o}
	err := d.run(ctx)
	d.cleanup() // a second Ctrl-C in here makes it quick
	interrupted := ctx.Err() != nil
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
	if interrupted {
		os.Exit(130)
	}
}

// demo holds what it created, for cleanup.
type demo struct {
	opts options

	dir      string // temporary files
	pinDir   string // a private bpffs, mounted
	mounted  bool
	config   string
	count    string
	agentLog string

	pair   *nettest.Pair
	recv   *nettest.Receiver
	sender *nettest.Sender
	client io.Closer
	agent  *exec.Cmd
	exited chan struct{}
}

func (d *demo) run(ctx context.Context) error {
	o := d.opts
	var err error
	if o.rlagent, err = filepath.Abs(o.rlagent); err != nil {
		return err
	}
	if _, err := os.Stat(o.rlagent); err != nil {
		return fmt.Errorf("the rlagent binary: %w (make demo builds bin/rlagent)", err)
	}
	if d.dir, err = os.MkdirTemp("", "rlagent-demo-"); err != nil {
		return err
	}
	d.pinDir = filepath.Join(d.dir, "bpf")
	d.config = filepath.Join(d.dir, "rlagent.yaml")
	d.count = filepath.Join(d.dir, "replicas")
	d.agentLog = filepath.Join(d.dir, "agent.log")
	if err := os.Mkdir(d.pinDir, 0o700); err != nil {
		return err
	}
	if err := unix.Mount("bpffs", d.pinDir, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs at %s: %w", d.pinDir, err)
	}
	d.mounted = true

	d.pair, err = nettest.NewPair(nettest.PairConfig{NameA: "client", NameB: "server", IfA: "veth-client", IfB: "veth-server"})
	if err != nil {
		return err
	}
	conn, err := d.pair.B.ListenUDP("udp", netip.AddrPortFrom(netip.IPv6Unspecified(), port), 16<<20)
	if err != nil {
		return err
	}
	d.recv = nettest.StartReceiver(conn, nettest.ReceiverConfig{Bin: 10 * time.Millisecond, Span: 10 * time.Minute})

	if err := writeAtomic(d.count, fmt.Sprintf("%d\n", o.counts[0])); err != nil {
		return err
	}
	config := fmt.Sprintf(`# Written by the rlagent demo.
interfaces: [%s]
pinDir: %s
metricsAddress: "off"
count:
  file: %s
limits:
  - name: %s
    rate: %d
    match:
      protocol: udp
      dstPorts: [%d]
`, d.pair.IfB, d.pinDir, d.count, limitName, o.rate, port)
	if err := writeAtomic(d.config, config); err != nil {
		return err
	}
	if err := d.startAgent(ctx); err != nil {
		return err
	}

	client, err := d.pair.A.DialUDP(netip.AddrPortFrom(d.pair.B4, port))
	if err != nil {
		return err
	}
	d.client = client
	total := time.Duration(len(o.counts)) * o.phase
	d.sender, err = nettest.StartSender(client, nettest.SenderConfig{
		Rate:     o.offered,
		Count:    int64(o.offered*total.Seconds()*1.1) + 1,
		Duration: total + 2*time.Second,
	})
	if err != nil {
		return err
	}
	d.header(config)
	return d.show(ctx, total)
}

func (d *demo) header(config string) {
	o := d.opts
	var arrows []string
	for _, c := range o.counts {
		arrows = append(arrows, strconv.Itoa(c))
	}
	fmt.Printf(`
rlagent demo: one global limit, divided among replicas

  The limit: %d pkt/s to UDP port %d over all replicas. Each replica's agent
  enforces its node share, global / replicas, in XDP. Here rlagent runs in the
  "server" namespace (%s) as one replica, and reads the replica count from a
  file that the demo sets to %s, %s each. The "client" namespace
  (%s) floods UDP/%d at %.0f pkt/s over a veth pair.

  Each line is one second: the count in the file; the replicas and node share
  that 'rlagent status -o json' reports; the packets per second the client
  offered; and those a socket in "server" received (what rlagent admitted),
  against the share. The count file changes between two lines; the agent applies
  it within about 0.2 s (it polls the file), so the line after a change shows
  both shares. Ctrl-C stops early; everything the demo created is removed
  either way.

  Config (%s):
`, o.rate, port, d.pair.B4, strings.Join(arrows, " -> "), o.phase, d.pair.A4, port, o.offered, d.config)
	for l := range strings.SplitSeq(strings.TrimSpace(config), "\n") {
		if !strings.HasPrefix(l, "#") {
			fmt.Println("    " + l)
		}
	}
	fmt.Printf("\n%6s  %5s  %8s  %10s  %10s  %10s  %8s\n", "time", "count", "replicas", "share/s", "offered/s", "admitted/s", "vs share")
}

// second is one printed line: the second from from.
type second struct {
	from              time.Time
	count             int
	share             uint64
	admitted, offered float64
}

func (d *demo) show(ctx context.Context, total time.Duration) error {
	o := d.opts
	start := time.Now()
	late := 150 * time.Millisecond // admitted packets still on their way
	var lines []second
	phase := 0
	wait := func(until time.Time) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-d.exited:
			return fmt.Errorf("rlagent exited early; its log:\n%s", tail(d.agentLog, 20))
		case <-time.After(time.Until(until)):
			return nil
		}
	}
	for k := 1; time.Duration(k)*time.Second <= total; k++ {
		end := start.Add(time.Duration(k) * time.Second)
		err := wait(end)
		if errors.Is(err, context.Canceled) {
			fmt.Println("\ninterrupted")
			d.summary(lines) // no verdict on part of a run
			return nil
		}
		if err != nil {
			return err
		}
		// What the agent enforced during the second that just ended.
		st, err := d.status()
		if err != nil {
			return err
		}
		// The next count, at the phase boundary.
		next := int(time.Duration(k) * time.Second / o.phase)
		if next != phase && next < len(o.counts) {
			if err := writeAtomic(d.count, fmt.Sprintf("%d\n", o.counts[next])); err != nil {
				return err
			}
		}
		if err := wait(end.Add(late)); err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
		from := end.Add(-time.Second)
		line := second{from: from, count: o.counts[phase], share: st.ShareRate, admitted: d.recv.Got().Rate(from, end),
			offered: d.sender.Sent().Rate(from, end)}
		fmt.Printf("%5ds  %5d  %8d  %10d  %10.0f  %10.0f  %+7.1f%%\n", k, line.count, st.Replicas, st.ShareRate,
			line.offered, line.admitted, pctDiff(line.admitted, float64(st.ShareRate)))
		lines = append(lines, line)
		if next != phase && next < len(o.counts) {
			fmt.Printf("        count file: %d -> %d\n", o.counts[phase], o.counts[next])
			phase = next
		}
	}
	// The summary counts again what arrived in each second, with the
	// packets that were still on their way when its line printed (a busy
	// machine delays the receiver by more than late).
	if err := wait(time.Now().Add(500 * time.Millisecond)); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	for i := range lines {
		lines[i].admitted = d.recv.Got().Rate(lines[i].from, lines[i].from.Add(time.Second))
	}
	return d.verdict(d.summary(lines))
}

// phaseResult is one count's seconds once its share applied.
type phaseResult struct {
	count             int
	share             uint64 // the last share status reported
	admitted, offered float64
	from, to          int // the seconds measured, as printed; none if from > to
}

func (r phaseResult) seconds() string {
	switch {
	case r.from > r.to:
		return "no second"
	case r.from == r.to:
		return fmt.Sprintf("second %d", r.from)
	}
	return fmt.Sprintf("seconds %d-%d", r.from, r.to)
}

// summary prints, per phase, the mean admitted rate against the share over
// the seconds after the first line whose status shows the phase's share:
// each phase but its first second, or more where the change applied late
// (the agent polls the count file; a busy machine delays it).
func (d *demo) summary(lines []second) []phaseResult {
	if len(lines) == 0 {
		return nil
	}
	var out []phaseResult
	fmt.Printf("\nSummary (each count's seconds after the first line that shows its share):\n")
	fmt.Printf("  %5s  %10s  %15s  %7s\n", "count", "share/s", "mean admitted/s", "error")
	for i := 0; i < len(lines); {
		j := i + 1
		for j < len(lines) && lines[j].count == lines[i].count {
			j++
		}
		m := i
		for m < j-1 && lines[m].share != d.opts.rate/uint64(lines[i].count) {
			m++
		}
		r := phaseResult{count: lines[i].count, share: lines[j-1].share, from: m + 2, to: j}
		if n := j - m - 1; n > 0 {
			for _, l := range lines[m+1 : j] {
				r.admitted += l.admitted / float64(n)
				r.offered += l.offered / float64(n)
			}
			fmt.Printf("  %5d  %10d  %15.0f  %+6.2f%%   (%d s)\n", r.count, r.share, r.admitted, pctDiff(r.admitted, float64(r.share)), n)
		} else {
			fmt.Printf("  %5d  %10d  %15s  %7s   (the share applied in its last second)\n", r.count, r.share, "-", "-")
		}
		out = append(out, r)
		i = j
	}
	return out
}

// verdict checks each phase against its share, global / count: status must
// report that share, and the mean admitted rate must be within the
// tolerance of it. It prints the verdict and returns an error naming every
// count that is off.
func (d *demo) verdict(phases []phaseResult) error {
	o := d.opts
	var off []string
	worst := 0.0
	for _, r := range phases {
		want := float64(o.rate) / float64(r.count)
		e := pctDiff(r.admitted, want)
		worst = max(worst, math.Abs(e))
		switch {
		case r.from > r.to:
			off = append(off, fmt.Sprintf("count %d: status showed its share %.0f only in the phase's last second, or never: nothing measured",
				r.count, want))
		case r.share != o.rate/uint64(r.count):
			off = append(off, fmt.Sprintf("count %d (%s): status reports a share of %d pkt/s, want %d / %d = %.0f",
				r.count, r.seconds(), r.share, o.rate, r.count, want))
		case math.Abs(e) > o.tolerance:
			msg := fmt.Sprintf("count %d (%s): admitted %.0f pkt/s, %+.2f%% off its share %.0f (tolerance %g%%)",
				r.count, r.seconds(), r.admitted, e, want, o.tolerance)
			if r.offered < 1.3*want {
				msg += fmt.Sprintf("; the client offered only %.0f pkt/s: the machine was too busy to send", r.offered)
			}
			off = append(off, msg)
		}
	}
	// Repeated counts in a row are one phase in the summary.
	if want := len(slices.Compact(slices.Clone(o.counts))); len(phases) != want {
		off = append(off, fmt.Sprintf("%d of the %d phases measured", len(phases), want))
	}
	if len(off) > 0 {
		return fmt.Errorf("the admitted rate is off the share:\n  %s", strings.Join(off, "\n  "))
	}
	fmt.Printf("\nEvery count's admitted rate is within %g%% of its share (the largest error: %.2f%%).\n", o.tolerance, worst)
	return nil
}

func pctDiff(got, want float64) float64 {
	if want == 0 {
		return math.NaN()
	}
	return (got - want) / want * 100
}

// startAgent runs `rlagent run` in the server namespace and waits until it
// has attached.
func (d *demo) startAgent(ctx context.Context) error {
	logf, err := os.Create(d.agentLog)
	if err != nil {
		return err
	}
	defer logf.Close() // the child has its own descriptor
	cmd := exec.Command(d.opts.rlagent, "run", "--config", d.config)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := d.pair.B.Start(cmd); err != nil {
		return err
	}
	d.agent, d.exited = cmd, make(chan struct{})
	go func() {
		cmd.Wait()
		close(d.exited)
	}()
	// A first verifier run can stall for seconds on a busy or freshly
	// booted machine (agenttest.AttachTimeout).
	const attachTimeout = 30 * time.Second
	deadline := time.Now().Add(attachTimeout)
	for {
		b, _ := os.ReadFile(d.agentLog)
		for _, l := range strings.Split(string(b), "\n") {
			if strings.Contains(l, "attached XDP") || strings.Contains(l, "native XDP not available") {
				fmt.Printf("rlagent (pid %d): %s\n", cmd.Process.Pid, logMsg(l))
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-d.exited:
			return fmt.Errorf("rlagent run exited: %s", tail(d.agentLog, 20))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("rlagent run did not attach within %v: %s", attachTimeout, tail(d.agentLog, 20))
		}
	}
}

// logMsg shortens a slog text line to its message and attributes.
func logMsg(line string) string {
	if i := strings.Index(line, "msg="); i >= 0 {
		return line[i+len("msg="):]
	}
	return line
}

// status is the demo limit's line of `rlagent status -o json`.
func (d *demo) status() (agent.LimitStatus, error) {
	out, err := exec.Command(d.opts.rlagent, "status", "--pin-dir", d.pinDir, "--output", "json").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return agent.LimitStatus{}, fmt.Errorf("rlagent status: %w: %s", err, ee.Stderr)
		}
		return agent.LimitStatus{}, fmt.Errorf("rlagent status: %w", err)
	}
	var st []agent.LimitStatus
	if err := json.Unmarshal(out, &st); err != nil {
		return agent.LimitStatus{}, fmt.Errorf("rlagent status: %w", err)
	}
	for _, s := range st {
		if s.Name == limitName {
			return s, nil
		}
	}
	return agent.LimitStatus{}, fmt.Errorf("rlagent status shows no limit %s", limitName)
}

// cleanup removes everything run created, in reverse order. A second
// Ctrl-C while it runs skips the polite steps.
func (d *demo) cleanup() {
	force := make(chan os.Signal, 1)
	signal.Notify(force, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(force)
	forced := func() bool {
		select {
		case <-force:
			return true
		default:
			return false
		}
	}
	var done []string
	if d.sender != nil {
		d.sender.Stop()
	}
	if d.client != nil {
		d.client.Close()
	}
	if d.agent != nil && d.agent.Process != nil {
		select {
		case <-d.exited:
		default:
			d.agent.Process.Signal(syscall.SIGTERM)
			select {
			case <-d.exited:
			case <-force:
				d.agent.Process.Kill()
				<-d.exited
			case <-time.After(5 * time.Second):
				fmt.Fprintf(os.Stderr, "demo: rlagent (pid %d) ignored SIGTERM for 5 s: killing it\n", d.agent.Process.Pid)
				d.agent.Process.Kill()
				<-d.exited
			}
		}
		done = append(done, fmt.Sprintf("stopped rlagent (pid %d)", d.agent.Process.Pid))
	}
	if d.mounted {
		if !forced() {
			out, err := exec.Command(d.opts.rlagent, "cleanup", "--pin-dir", d.pinDir).CombinedOutput()
			if err != nil {
				fmt.Fprintf(os.Stderr, "demo: rlagent cleanup: %v: %s\n", err, out)
			} else {
				done = append(done, "rlagent cleanup (XDP detached, pins removed)")
			}
		}
		// Unmounting the private bpffs drops whatever pins are left.
		if err := unix.Unmount(d.pinDir, unix.MNT_DETACH); err != nil {
			fmt.Fprintf(os.Stderr, "demo: unmount %s: %v\n", d.pinDir, err)
		} else {
			done = append(done, "unmounted its bpffs")
		}
	}
	if d.recv != nil {
		d.recv.Close()
	}
	if d.pair != nil {
		d.pair.Close()
		done = append(done, "closed the namespaces")
	}
	if d.dir != "" {
		if err := os.RemoveAll(d.dir); err != nil {
			fmt.Fprintf(os.Stderr, "demo: %v\n", err)
		} else {
			done = append(done, "removed "+d.dir)
		}
	}
	if len(done) > 0 {
		fmt.Printf("\nCleaned up: %s.\n", strings.Join(done, ", "))
	}
}

func writeAtomic(path, content string) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// tail is the last n lines of a file.
func tail(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	return strings.Join(lines, "\n")
}
