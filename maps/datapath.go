package maps

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/rlagent/rlagent/bpf"
)

// Clock is where the data path reads the time.
type Clock uint8

const (
	// ClockJiffies is bpf_jiffies64: inlined by the JIT, tick resolution
	// (1-10 ms). The default: the over-limit path reads the clock on every
	// packet, and this is the cheapest clock (docs/benchmarks.md).
	ClockJiffies Clock = iota
	// ClockKtime is bpf_ktime_get_ns.
	ClockKtime
	// ClockCoarse is bpf_ktime_get_coarse_ns (Linux 5.11+).
	ClockCoarse
	// ClockTest is a clock the caller sets with SetTestClock, advanced by a
	// fixed step before every packet. For tests only.
	ClockTest
)

func (c Clock) kind() bpf.RatelimitRlClockKind {
	switch c {
	case ClockKtime:
		return bpf.RatelimitRlClockKindRL_CLOCK_KTIME
	case ClockCoarse:
		return bpf.RatelimitRlClockKindRL_CLOCK_COARSE
	case ClockTest:
		return bpf.RatelimitRlClockKindRL_CLOCK_TEST
	}
	return bpf.RatelimitRlClockKindRL_CLOCK_JIFFIES
}

// String names the clock.
func (c Clock) String() string {
	return [...]string{"jiffies", "ktime", "coarse", "test"}[c&3]
}

// Options configure Load. The zero value is usable.
type Options struct {
	// PinDir, if set, is a directory on a bpffs where the maps are pinned
	// by name (and picked up again by a later Load).
	PinDir string
	// Clock defaults to ClockJiffies.
	Clock Clock
	// MaxBuckets is the number of keyed buckets held at once, over all
	// keyed limits (default 65536): a table of twice as many ways,
	// rounded up to a power of two, in sets of four indexed by the keyed
	// hash. A new key whose set is full evicts the bucket in it that will
	// be full soonest (one that is full already, if any: nothing is lost
	// then).
	MaxBuckets uint32
	// CPUs is the number of CPUs leases are sized for (default: possible CPUs).
	CPUs int
	// HashSeed keys the hash that places keyed buckets in the per-CPU
	// cache, for new maps (pinned maps keep theirs). Zero, the default,
	// draws a random one; tests set it to aim at cache sets.
	HashSeed [2]uint64
	// XDPOnly loads the XDP programs and not the TC ones (TCProgram then
	// returns nil), for callers that never attach a TC program: the
	// verifier takes ~0.4 s for each of the four.
	XDPOnly bool

	// layoutEpoch, if set, replaces layoutEpoch: tests migrate across an
	// epoch with it.
	layoutEpoch uint32
}

// Datapath is a loaded data path.
type Datapath struct {
	objs bpf.RatelimitObjects
	opts Options
	ncpu int
	// tick is how far the clock moves at a time, in ns: a jiffy for the
	// jiffies and coarse clocks, 0 for the precise ones.
	tick  uint64
	state *classifier
	// limits mirrors what is written to rl_limits, by id.
	limits map[uint32]*installed
	// protect mirrors the protect maps; nil until SetProtected reads them.
	protect *protection
	// spec is what was loaded, load-time constants set.
	spec *ebpf.CollectionSpec
	// layoutDir holds the maps' pins (see layout.go); migration is the
	// earlier layout found, until FinishMigration.
	layoutDir string
	migration *Migration
	// buckets is rl_buckets mapped into memory (bucketTable), bucketMem
	// the mapping; nil until the agent first changes a way.
	buckets   []bpf.RatelimitRlBucketSet
	bucketMem []byte
}

type installed struct {
	limit Limit
	entry bpf.RatelimitRlLimit
}

// Load loads the data path into the kernel. It does not attach it.
func Load(opts Options) (*Datapath, error) {
	if opts.Clock > ClockTest {
		return nil, fmt.Errorf("clock: %d is not one of jiffies, ktime, coarse, test", opts.Clock)
	}
	if opts.MaxBuckets == 0 {
		opts.MaxBuckets = 65536
	}
	ncpu := opts.CPUs
	if ncpu <= 0 {
		n, err := ebpf.PossibleCPU()
		if err != nil {
			return nil, fmt.Errorf("count possible CPUs: %w", err)
		}
		ncpu = n
	}

	spec, err := bpf.LoadRatelimit()
	if err != nil {
		return nil, fmt.Errorf("read data path ELF: %w", err)
	}
	if err := spec.Variables["rl_clock_src"].Set(uint32(opts.Clock.kind())); err != nil {
		return nil, fmt.Errorf("set clock: %w", err)
	}
	var tick uint64
	if opts.Clock == ClockJiffies || opts.Clock == ClockCoarse {
		var res unix.Timespec
		// The resolution of the coarse clock is one tick: the length of a jiffy.
		if err := unix.ClockGetres(unix.CLOCK_MONOTONIC_COARSE, &res); err != nil {
			return nil, fmt.Errorf("read jiffy length: %w", err)
		}
		tick = uint64(res.Nano())
	}
	if opts.Clock == ClockJiffies {
		if err := spec.Variables["rl_ns_per_jiffy"].Set(tick); err != nil {
			return nil, fmt.Errorf("set jiffy length: %w", err)
		}
	}
	sets := bucketSets(opts.MaxBuckets)
	spec.Maps[bpf.RatelimitMapRlBuckets].MaxEntries = sets
	spec.Maps[bpf.RatelimitMapRlBucketKeys].MaxEntries = sets
	if err := spec.Variables["rl_bucket_mask"].Set(sets - 1); err != nil {
		return nil, fmt.Errorf("set bucket table mask: %w", err)
	}
	// Tombstones: a set of RL_TOMB_WAYS per way of the table, so that a
	// returning key is still recognised, and starts where its evicted
	// bucket would be, after other keys have come and gone.
	tomb := sets * uint32(bucketWays)
	spec.Maps[bpf.RatelimitMapRlTombstones].MaxEntries = tomb
	if err := spec.Variables["rl_tombstone_mask"].Set(tomb - 1); err != nil {
		return nil, fmt.Errorf("set tombstone mask: %w", err)
	}

	d := &Datapath{opts: opts, ncpu: ncpu, tick: tick, limits: make(map[uint32]*installed), spec: spec}
	var copts ebpf.CollectionOptions
	var prev string // the current layout's directory, if another
	fresh := false  // the layout's maps are created now
	epoch := uint32(layoutEpoch)
	if opts.layoutEpoch != 0 {
		epoch = opts.layoutEpoch
	}
	if opts.PinDir != "" {
		if err := os.MkdirAll(opts.PinDir, 0o700); err != nil {
			return nil, fmt.Errorf("create pin directory: %w", err)
		}
		cur, err := currentDir(opts.PinDir)
		if err != nil {
			return nil, fmt.Errorf("pin directory: %w", err)
		}
		d.layoutDir = filepath.Join(opts.PinDir, layoutName(spec, epoch))
		if cur != d.layoutDir {
			prev = cur
		}
		if _, err := os.Stat(filepath.Join(d.layoutDir, bpf.RatelimitMapRlLimits)); errors.Is(err, os.ErrNotExist) {
			fresh = true
		}
		if err := os.MkdirAll(d.layoutDir, 0o700); err != nil {
			return nil, fmt.Errorf("create pin directory: %w", err)
		}
		copts.Maps.PinPath = d.layoutDir
	} else {
		for _, m := range spec.Maps {
			m.Pinning = ebpf.PinNone
		}
	}

	if err := d.loadObjects(&copts); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("load data path: %+v", ve)
		}
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return nil, fmt.Errorf("load data path: the maps pinned in %s do not match this data path "+
				"(made by another version of rlagent, or with another maxBuckets; `rlagent cleanup` removes them, "+
				"and enforcement stops until the agent attaches again): %w",
				opts.PinDir, err)
		}
		return nil, fmt.Errorf("load data path: %w", err)
	}
	switch {
	case prev != "" && fresh:
		// Another layout is current: take what can be taken from it.
		mig, err := d.copyMaps(prev, epochOf(opts.PinDir, prev) == epoch)
		if err != nil {
			// The new layout's maps are pinned already: take them away,
			// or the next Load would take them for a migration begun and
			// copy nothing. The earlier layout stays current.
			d.objs.Close()
			removeMapPins(d.layoutDir)
			os.Remove(d.layoutDir)
			return nil, fmt.Errorf("migrate the maps pinned in %s: %w", prev, err)
		}
		d.migration = mig
	case prev != "":
		// A migration that an earlier agent began: this layout's maps
		// hold what it copied and wrote.
		d.migration = &Migration{From: prev}
	case opts.PinDir != "":
		if err := setCurrent(opts.PinDir, d.layoutDir); err != nil {
			d.objs.Close()
			return nil, fmt.Errorf("pin directory: %w", err)
		}
	}
	if err := d.adopt(); err != nil {
		d.objs.Close()
		return nil, err
	}
	return d, nil
}

// loadObjects loads d's maps and programs (the XDP ones only, with
// XDPOnly) into d.objs.
func (d *Datapath) loadObjects(copts *ebpf.CollectionOptions) error {
	if !d.opts.XDPOnly {
		return d.spec.LoadAndAssign(&d.objs, copts)
	}
	var o struct {
		bpf.RatelimitMaps
		bpf.RatelimitVariables
		XdpRatelimit  *ebpf.Program `ebpf:"xdp_ratelimit"`
		XdpClockProbe *ebpf.Program `ebpf:"xdp_clock_probe"`
	}
	if err := d.spec.LoadAndAssign(&o, copts); err != nil {
		return err
	}
	d.objs.RatelimitMaps, d.objs.RatelimitVariables = o.RatelimitMaps, o.RatelimitVariables
	d.objs.XdpRatelimit, d.objs.XdpClockProbe = o.XdpRatelimit, o.XdpClockProbe
	return nil
}

func (d *Datapath) collectionSpec() (*ebpf.CollectionSpec, error) {
	if d.spec == nil {
		return nil, errors.New("no program loaded (a pinned view)")
	}
	return d.spec, nil
}

// mapsByName are d's maps by their names in the ELF.
func (d *Datapath) mapsByName() map[string]*ebpf.Map {
	out := make(map[string]*ebpf.Map)
	v := reflect.ValueOf(&d.objs.RatelimitMaps).Elem()
	for i := range v.NumField() {
		if m, ok := v.Field(i).Interface().(*ebpf.Map); ok && m != nil {
			out[v.Type().Field(i).Tag.Get("ebpf")] = m
		}
	}
	return out
}

// Close releases the data path's file descriptors. Pinned maps stay.
func (d *Datapath) Close() error {
	return errors.Join(d.unmapBuckets(), d.objs.Close())
}

// Program is the XDP program: it enforces the limits of hook UplinkIn on
// an uplink's ingress.
func (d *Datapath) Program() *ebpf.Program { return d.objs.XdpRatelimit }

// TCProgram is the TC program (BPF_PROG_TYPE_SCHED_CLS) that enforces the
// limits of hook h, or nil for an unknown hook (or with Options.XDPOnly). It works attached with tcx
// (it passes a packet with TCX_NEXT, so the programs after it run) and as a
// clsact direct-action filter (the same value is TC_ACT_UNSPEC there); it
// drops with TC_ACT_SHOT. Where it goes (see Hook): UplinkIn on an uplink's
// ingress (instead of Program), UplinkOut on an uplink's egress,
// EndpointIn on the egress of an endpoint's host-side veth, EndpointOut on
// its ingress.
func (d *Datapath) TCProgram(h Hook) *ebpf.Program {
	switch h {
	case UplinkIn:
		return d.objs.TcUplinkIn
	case UplinkOut:
		return d.objs.TcUplinkOut
	case EndpointIn:
		return d.objs.TcEndpointIn
	case EndpointOut:
		return d.objs.TcEndpointOut
	}
	return nil
}

// CPUs is the number of CPUs leases are sized for.
func (d *Datapath) CPUs() int { return d.ncpu }

// Now reads the data path's clock, in nanoseconds.
func (d *Datapath) Now() (uint64, error) {
	now, _, err := d.clocks()
	return now, err
}

// paceNow reads the clock of paced limits (CLOCK_MONOTONIC, the time base
// of departure times; the test clock with ClockTest), in nanoseconds.
func (d *Datapath) paceNow() (uint64, error) {
	_, now, err := d.clocks()
	return now, err
}

// clockOf reads the clock that a limit with action a keeps its buckets on.
func (d *Datapath) clockOf(a Action) (uint64, error) {
	if a == Pace {
		return d.paceNow()
	}
	return d.Now()
}

// clocks reads both clocks of the data path.
func (d *Datapath) clocks() (now, pace uint64, err error) {
	ret, err := d.objs.XdpClockProbe.Run(&ebpf.RunOptions{Data: make([]byte, 64)})
	if err != nil {
		return 0, 0, fmt.Errorf("read data path clock: %w", err)
	}
	if ret != 2 { // XDP_PASS
		return 0, 0, fmt.Errorf("read data path clock: probe returned %d", ret)
	}
	if err := d.objs.RlClockProbeOut.Get(&now); err != nil {
		return 0, 0, fmt.Errorf("read data path clock: %w", err)
	}
	if err := d.objs.RlPaceProbeOut.Get(&pace); err != nil {
		return 0, 0, fmt.Errorf("read data path clock: %w", err)
	}
	return now, pace, nil
}

// ErrNoTestClock means the data path was not loaded with ClockTest.
var ErrNoTestClock = errors.New("data path not loaded with ClockTest")

// SetTestClock sets the test clock: now, and how far it moves before each
// packet. Only for a Datapath loaded with ClockTest.
func (d *Datapath) SetTestClock(now, step uint64) error {
	if d.opts.Clock != ClockTest {
		return fmt.Errorf("set test clock: %w", ErrNoTestClock)
	}
	return d.objs.RlTestNow.Set(bpf.RatelimitRlTestClock{Now: now, Step: step})
}

// TestClock reads the test clock.
func (d *Datapath) TestClock() (uint64, error) {
	var c bpf.RatelimitRlTestClock
	if err := d.objs.RlTestNow.Get(&c); err != nil {
		return 0, err
	}
	return c.Now, nil
}
