package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/client-go/rest"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/attach"
	"github.com/rlagent/rlagent/cluster"
	"github.com/rlagent/rlagent/maps"
	"github.com/rlagent/rlagent/watcher"
)

// Options configure Run.
type Options struct {
	// ConfigPath is the YAML config file (Required). It is watched.
	ConfigPath string
	// Log defaults to slog.Default().
	Log *slog.Logger
	// ConfigPoll is how often the config file is checked for changes
	// (default 500 ms).
	ConfigPoll time.Duration
	// Ready, if set, is called once the data path is attached and the
	// first reconcile is done, with the metrics address actually bound.
	Ready func(metricsAddr string)
	// Kubernetes, if set, is the cluster: the limits are its RateLimit
	// objects, and the nodes and service scopes are divided by its counts.
	Kubernetes *watcher.Kubernetes
	// Identity is this agent's name in the election of the agent that
	// writes RateLimit status (its pod's name; default: the host's name).
	Identity string
	// APIServer, if set, follows the endpoints of the agent's API server
	// connection, which protectAPIServer protects (see protect.go).
	APIServer *watcher.APIServer
	// KubeConfig, if set, is the cluster's client config: the secure
	// metrics listener (secureMetrics) has its API server check each
	// scrape. A config with secureMetrics needs it.
	KubeConfig *rest.Config
	// PinDir, if set, replaces the config file's pinDir (a flag of run).
	PinDir string
	// EphemeralPins accepts a pin directory that does not outlive the
	// agent (a bpffs of its own in a private mount namespace): enforcement
	// then stops when the agent does. See preparePinDir.
	EphemeralPins bool
	// HostIPs are the node's own addresses (in a pod: status.hostIPs):
	// with interfaces: auto, the interfaces that hold them are uplinks.
	HostIPs []netip.Addr
}

// Agent is a running node agent.
type Agent struct {
	opts Options
	log  *slog.Logger

	mu    sync.Mutex // guards everything below
	cfg   *v1alpha1.Config
	dp    *maps.Datapath
	att   *attach.Attacher // finds endpoints and addresses; keeps no handles
	hooks hookSet          // attaches (the first att: the pins are its state)
	// uplinks are the interfaces the uplink programs run on: the config's,
	// or what interfaces: auto found (refreshUplinks).
	uplinks []string
	source  watcher.Source
	stopSrc context.CancelFunc
	k8s     *watcher.Kubernetes
	writer  *cluster.StatusWriter // in a cluster, once statusLoop runs
	// writerDone is closed when the status writer's candidacy ended (its
	// Lease released, if it held it).
	writerDone chan struct{}
	ap         applier                 // writes the limits; what became of each (outcomes)
	pending    map[uint32]counterSnap  // counters read at the last tick
	keys       keyCounter              // the metrics' bucket counts (keyCountEvery)
	demand     map[string]*demandState // share demand: by limit name
	// hotSince is the hot-key tick the next read of the data path's
	// records starts at, once hotPrimed (observeHotKeys).
	hotSince  uint32
	hotPrimed bool
	warned    map[string]string          // limit name -> last warning logged
	protect   protectState               // protect rules written (own lock)
	lock      *pinLock                   // the pin directory's, for the agent's life
	ifState   map[string]InterfaceStatus // by attach.Point
	logged    map[string]bool            // warnings logged once (logOnce)
	health    health                     // own lock: the probes never wait for a reconcile

	reconcileErrors prometheus.Counter

	reloadErrors prometheus.Counter
	reloads      prometheus.Counter
	notify       chan struct{}
	statusDue    chan struct{}
}

// reconcileRetry is how long after a failed reconcile the agent tries
// again if nothing else made it.
const reconcileRetry = 5 * time.Second

// Run runs the agent until ctx ends. On return the data path stays
// attached and pinned, enforcing the last shares.
func Run(ctx context.Context, opts Options) error {
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	if opts.ConfigPoll <= 0 {
		opts.ConfigPoll = 500 * time.Millisecond
	}
	cfg, err := loadConfig(opts)
	if err != nil {
		return err
	}
	a := &Agent{
		opts:      opts,
		log:       opts.Log,
		pending:   make(map[uint32]counterSnap),
		demand:    make(map[string]*demandState),
		warned:    make(map[string]string),
		notify:    make(chan struct{}, 1),
		statusDue: make(chan struct{}, 1),
		reloadErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "rlagent_config_reload_errors_total",
			Help: "Config files rejected (invalid, or not appliable); the previous config stayed in force.",
		}),
		reloads: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "rlagent_config_reloads_total",
			Help: "Config files applied after a change.",
		}),
		reconcileErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "rlagent_reconcile_errors_total",
			Help: "Reconciles that failed as a whole (the agent is not ready until one succeeds).",
		}),
	}
	a.health.extra = a.protectHealth
	if err := a.start(ctx, cfg); err != nil {
		a.close()
		return err
	}
	defer a.close()

	// The data path's and the cluster's metrics are served from a snapshot
	// the loop below updates: a scrape never waits for the agent's lock.
	snapMetrics := newSnapshot(&collector{read: a.readStatus}, clusterCollector{a})
	snapMetrics.update()
	reg := prometheus.NewRegistry()
	reg.MustRegister(a.reloadErrors, a.reloads, snapMetrics, &a.protect,
		a.reconcileErrors, &a.health)
	srv, addr, err := a.serveMetrics(cfg.MetricsAddress, reg)
	if err != nil {
		return err
	}
	if srv != nil {
		defer srv.Close()
	}
	// The plain listener's handler (its /metrics) if it has one: one
	// scrape at a time over both listeners.
	var scrape http.Handler
	if srv != nil {
		scrape = srv.Handler
	} else {
		scrape = promhttp.HandlerFor(reg, promhttp.HandlerOpts{MaxRequestsInFlight: 1})
	}
	ssrv, _, err := serveSecureMetrics(cfg.SecureMetrics, opts.KubeConfig, scrape, a.log)
	if err != nil {
		return err
	}
	if ssrv != nil {
		defer ssrv.Close()
	}
	if opts.Ready != nil {
		opts.Ready(addr)
	}

	go a.watchConfig(ctx)
	go a.watchLinks(ctx)
	if a.k8s != nil {
		a.writerDone = make(chan struct{})
		go a.statusLoop(ctx)
		go a.demandLoop(ctx)
	}
	snap := time.NewTicker(time.Second)
	defer snap.Stop()
	for {
		a.health.heartbeat(time.Now())
		select {
		case <-ctx.Done():
			if opts.EphemeralPins {
				a.log.Info("stopping; the pins are ephemeral (--ephemeral-pins): enforcement may end with the agent")
			} else {
				a.mu.Lock()
				a.demandDown(time.Now())
				a.mu.Unlock()
				a.waitWriter(5 * time.Second)
				a.log.Info("stopping; the data path stays attached with the last shares")
			}
			return nil
		case <-a.notify:
			a.mu.Lock()
			err := a.reconcileRecorded()
			a.mu.Unlock()
			if err != nil {
				a.log.Error("reconcile", "error", err)
			}
			select {
			case a.statusDue <- struct{}{}:
			default:
			}
		case <-snap.C:
			if a.snapshot() {
				a.wake() // a demand-shared limit's share changed
			}
			// Before the health notes move (reportStale): what /readyz
			// says, the metrics say too.
			snapMetrics.update()
			a.reportStale()
			if a.health.retryDue(time.Now(), reconcileRetry) {
				a.wake()
			}
		}
	}
}

func (a *Agent) wake() {
	select {
	case a.notify <- struct{}{}:
	default:
	}
}

// waitWriter waits, at most timeout, for the status writer's candidacy to
// end: an agent that writes the status releases its Lease as it stops, so
// that another takes over within the election's retry period (2 s), not
// when the Lease expires (15 s: the allocation would go stale meanwhile).
func (a *Agent) waitWriter(timeout time.Duration) {
	if a.writerDone == nil {
		return
	}
	select {
	case <-a.writerDone:
	case <-time.After(timeout):
		a.log.Warn("the status writer did not stop in time; another agent takes over when its Lease expires", "waited", timeout)
	}
}

// start loads or adopts the data path, attaches it, starts the count source
// and does the first reconcile.
func (a *Agent) start(ctx context.Context, cfg *v1alpha1.Config) error {
	did, err := preparePinDir(cfg.PinDir, a.opts.EphemeralPins)
	if err != nil {
		return err
	}
	if did != "" {
		a.log.Info("pin directory: "+did, "pin_dir", cfg.PinDir)
	}
	if a.opts.EphemeralPins {
		a.log.Warn("--ephemeral-pins: the pins may not outlive the agent; if they do not, enforcement stops when it exits",
			"pin_dir", cfg.PinDir)
	}
	// Before anything in the directory is read or written: another agent
	// may own it.
	if a.lock, err = lockPinDir(cfg.PinDir); err != nil {
		return err
	}
	dp, err := maps.Load(maps.Options{PinDir: cfg.PinDir, MaxBuckets: cfg.MaxBuckets})
	if err != nil {
		return err
	}
	a.dp = dp
	a.cfg = cfg
	if mig := dp.Migrating(); mig != nil {
		// Another version of rlagent, or another maxBuckets: new maps
		// beside the old ones, which keep enforcing until the hooks move.
		a.log.Info("pin layout differs: migrating", "from", mig.From, "copied", mig.Copied, "rebuilt", mig.Rebuilt)
	}
	// The pod side of an endpoint is looked for only where it is used.
	a.att = attach.New(attach.Options{PinDir: cfg.PinDir, Log: a.log,
		SkipPeerNetns: cfg.EndpointHook != v1alpha1.EndpointHookPod})
	a.hooks = a.att
	a.ap = newApplier(dp, a.log)
	// What an earlier agent left is adopted as it is: the reconciles
	// compare with the pins themselves (names and ids in the metadata).
	if metas, err := dp.Metas(); err != nil {
		return err
	} else if len(metas) > 0 {
		a.log.Info("adopted pinned data path", "pin_dir", cfg.PinDir, "limits", len(metas))
	}
	a.startSource(ctx, cfg.Count)
	if k := a.opts.Kubernetes; k != nil {
		if len(cfg.Limits) > 0 {
			return errors.New("limits: in a cluster the limits are RateLimit objects; remove them from the config file")
		}
		a.k8s = k
		go k.Run(ctx, a.wake)
	}
	a.startProtect(ctx) // before the first attach
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.reconcileRecorded(); err != nil {
		return err
	}
	// The configured interfaces must attach: a config that names one that
	// is not there is rejected at the start. (The reconcile attached them
	// already, unless a cluster agent's caches are not synced yet; then the
	// pinned hooks stay as an earlier agent left them, none detached.)
	return a.syncLinks(a.placements(a.appliedLimits(), a.ap.points()), false)
}

func (a *Agent) startSource(ctx context.Context, c v1alpha1.CountSource) {
	if a.stopSrc != nil {
		a.stopSrc()
	}
	var src watcher.Source
	if c.File != "" {
		src = watcher.NewFile(c.File, 0, a.log.With("source", "file"))
	} else {
		n := 1
		if c.Static != nil {
			n = int(*c.Static)
		}
		src = watcher.NewStatic(n)
	}
	sctx, cancel := context.WithCancel(ctx)
	a.source, a.stopSrc = src, cancel
	if f, ok := src.(*watcher.File); ok {
		// Read once before the first reconcile: a file that is there
		// from the start must not be divided by "no count yet".
		f.Poll()
	}
	go src.Run(sctx, a.wake)
}

// close releases file descriptors; pins stay.
func (a *Agent) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.stopSrc != nil {
		a.stopSrc()
	}
	if a.dp != nil {
		a.dp.Close()
	}
	// Last: until the descriptors above are closed, this agent still owns
	// the pins.
	a.lock.release()
}

func (a *Agent) serveMetrics(addr string, reg *prometheus.Registry) (*http.Server, string, error) {
	if addr == v1alpha1.MetricsOff {
		return nil, "", nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, "", fmt.Errorf("metrics: listen on %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	// One scrape at a time: another one meanwhile gets 503 at once.
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{MaxRequestsInFlight: 1}))
	// /readyz is readiness and /livez liveness (see health); /healthz is
	// readiness too, where the readiness probe has always asked.
	mux.HandleFunc("/readyz", a.health.serveReady)
	mux.HandleFunc("/healthz", a.health.serveReady)
	mux.HandleFunc("/livez", a.health.serveLive)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout: metricsReadTimeout, WriteTimeout: metricsWriteTimeout, IdleTimeout: metricsIdleTimeout}
	go srv.Serve(ln)
	a.log.Info("serving metrics", "address", ln.Addr().String())
	return srv, ln.Addr().String(), nil
}

// watchConfig polls the config file and applies a changed, valid config.
func (a *Agent) watchConfig(ctx context.Context) {
	t := time.NewTicker(a.opts.ConfigPoll)
	defer t.Stop()
	last := fileStamp(a.opts.ConfigPath)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		cur := fileStamp(a.opts.ConfigPath)
		if cur == last {
			continue
		}
		last = cur
		if err := a.reload(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			a.reloadErrors.Inc()
			a.log.Error("config rejected; the previous config stays in force", "path", a.opts.ConfigPath, "error", err)
			continue
		}
		a.reloads.Inc()
	}
}

type stamp struct {
	mod  time.Time
	size int64
	ino  uint64
}

func fileStamp(path string) stamp {
	fi, err := os.Stat(path)
	if err != nil {
		return stamp{}
	}
	s := stamp{mod: fi.ModTime(), size: fi.Size()}
	if st, ok := fi.Sys().(interface{ Ino() uint64 }); ok {
		s.ino = st.Ino()
	}
	return s
}

// reload applies a changed config file, whole or not at all.
//
// What can fail is done first and undone on failure: the interfaces the new
// config adds are attached before any limit changes (they enforce the
// limits in force until the reconcile), and detached again if one of them
// cannot be attached or the reconcile fails; the hooks of the interfaces it
// drops are detached by the reconcile, once nothing can fail any more. An
// interface of both configs that is missing right now is not a reason to
// reject: the link watcher attaches it when it is back.
func (a *Agent) reload(ctx context.Context) error {
	cfg, err := loadConfig(a.opts)
	if err != nil {
		return err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return err // stopping: close may have run
	}
	// Whatever the outcome, the status writer follows the config in
	// force (and the count source, restarted or not) when this returns.
	defer a.configureWriter()
	old := a.cfg
	if cfg.PinDir != old.PinDir || cfg.MaxBuckets != old.MaxBuckets {
		return errors.New("pinDir and maxBuckets take effect on restart only: restore them or restart the agent")
	}
	// The new interfaces' hooks, attached with the limits now in force.
	a.cfg = cfg
	oldAtt, oldUplinks := a.att, a.uplinks
	a.refreshUplinks()
	if cfg.EndpointHook != old.EndpointHook {
		// The Attacher keeps no handles: a new one looks for the pods'
		// sides or not, as the new endpointHook needs.
		a.att = attach.New(attach.Options{PinDir: cfg.PinDir, Log: a.log,
			SkipPeerNetns: cfg.EndpointHook != v1alpha1.EndpointHookPod})
	}
	// added: the new interfaces' hooks. recheck: the XDP hooks of the
	// interfaces of both configs when xdpFallback changes: where another
	// program holds XDP, they run at TC ingress with tc and nowhere with
	// none, so a change to none there is rejected as a new such interface
	// is (and one to tc attaches the fallback before anything changes).
	var added, recheck []placement
	for _, p := range a.placements(a.appliedLimits(), nil) {
		switch {
		case !slices.Contains(oldUplinks, p.point.Iface):
			added = append(added, p)
		case cfg.XDPFallback != old.XDPFallback && p.point.Kind == attach.XDP:
			recheck = append(recheck, p)
		}
	}
	undoAttach := func() {
		for _, p := range added {
			for _, k := range []attach.Kind{p.point.Kind, attach.TCIngress} { // TCIngress: an xdpFallback
				if err := a.hooks.Detach(attach.Point{Iface: p.point.Iface, Kind: k}); err != nil {
					a.log.Error("rolling back a rejected config", "interface", p.point.Iface, "error", err)
				}
			}
		}
	}
	reject := func(err error) error {
		a.cfg, a.att, a.uplinks = old, oldAtt, oldUplinks
		undoAttach()
		a.syncLinks(a.placements(a.appliedLimits(), a.ap.points()), true)
		return err
	}
	if err := a.syncLinks(added, false); err != nil {
		return reject(err)
	}
	for _, p := range recheck {
		// An interface missing now is attached when it is back, as
		// before the reload.
		if _, _, err := a.hookSync().place(p); err != nil && !errors.Is(err, attach.ErrNoInterface) {
			return reject(err)
		}
	}

	if !reflect.DeepEqual(cfg.Count, old.Count) {
		a.startSource(ctx, cfg.Count)
	}
	if err := a.reconcileRecorded(); err != nil {
		a.cfg, a.att = old, oldAtt
		if !reflect.DeepEqual(cfg.Count, old.Count) {
			a.startSource(ctx, old.Count)
		}
		undoAttach()
		// A reconcile that failed may have written some limits before it
		// did: put the old config's back.
		if rerr := a.reconcileRecorded(); rerr != nil {
			a.log.Error("restoring the previous config's limits", "error", rerr)
		}
		return err
	}
	a.applyProtect("reload")
	a.log.Info("config applied", "path", a.opts.ConfigPath, "limits", len(cfg.Limits))
	return nil
}

// loadConfig reads the config file, with the options that override it.
func loadConfig(opts Options) (*v1alpha1.Config, error) {
	cfg, err := v1alpha1.LoadConfig(opts.ConfigPath)
	if err != nil {
		return nil, err
	}
	if opts.PinDir != "" {
		cfg.PinDir = opts.PinDir
	}
	if err := checkSecureMetrics(cfg.SecureMetrics, opts.KubeConfig); err != nil {
		return nil, err
	}
	if cfg.ProtectOff() { // at every start and reload, as protectAPIServer: false
		opts.Log.Warn(v1alpha1.ProtectOffWarning, "path", opts.ConfigPath)
	}
	return cfg, nil
}

// configureWriter gives the status writer, if one runs, what it takes from
// the config in force: the count source of the static scope and the demand
// shares' parameters. Callers hold a.mu.
func (a *Agent) configureWriter() {
	if a.writer != nil {
		a.writer.Configure(a.source, a.cfg.DemandShares)
	}
}

// statusLoop reports, after reconciles, what became of each RateLimit on
// this node (cluster.Reporter: an Event when it is not plainly applied), and
// runs this agent's candidacy for writing every RateLimit's status
// (cluster.StatusWriter), apart from the reconcile loop: an unreachable API
// server must not hold up enforcement.
func (a *Agent) statusLoop(ctx context.Context) {
	rep := cluster.NewReporter(a.k8s)
	defer rep.Close()
	id := a.opts.Identity
	if id == "" {
		id, _ = os.Hostname()
	}
	w := cluster.NewStatusWriter(a.k8s, cluster.StatusConfig{
		Identity: id,
		Log:      a.log.With("component", "status-writer"),
	})
	a.mu.Lock()
	a.writer = w
	a.configureWriter()
	a.mu.Unlock()
	go func() {
		defer close(a.writerDone)
		w.Run(ctx)
	}()

	t := time.NewTicker(time.Minute) // reports of problems are made again now and then
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.statusDue:
		case <-t.C:
		}
		w.Changed()
		all, invalid := a.k8s.Limits()
		now := time.Now()
		names := make(map[string]bool, len(all))
		for _, l := range all {
			names[l.Name] = true
			obj := a.k8s.RateLimit(l.Name)
			if obj == nil || invalid[l.Name] != nil {
				continue
			}
			var v cluster.Verdict
			a.mu.Lock()
			// What became of the limit on this node (nothing if it has no
			// endpoint here).
			if o := a.ap.outcomes[l.Name]; o != nil {
				switch o.state {
				case maps.Rejected:
					v.NotApplied = o.note
				case maps.Clamped:
					// The note ends with where the limit runs, if not at
					// its endpoints: the verdict says that apart.
					v.Clamped = strings.TrimSuffix(o.note, "; "+o.atUplink)
				}
				if o.state != maps.Rejected {
					v.AtUplink = o.atUplink
				}
				if o.enforced != nil && o.enforced.Action == v1alpha1.ActionPace {
					v.PaceIneffective = a.paceIneffective()
				}
			}
			v.AllocationRefused = a.demandRefused(l.Name)
			a.mu.Unlock()
			rep.Report(obj, v, now)
		}
		rep.Forget(func(name string) bool { return names[name] })
		if err := rep.Flush(ctx); err != nil {
			a.log.Debug("node verdicts not written to the node's Lease; retrying", "error", err)
		}
	}
}
