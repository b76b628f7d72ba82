package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/cilium/ebpf/link"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/rlagent/rlagent/api/v1alpha1"
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
}

// Agent is a running node agent.
type Agent struct {
	opts Options
	log  *slog.Logger

	mu      sync.Mutex // guards everything below
	cfg     *v1alpha1.Config
	dp      *maps.Datapath
	links   map[string]link.Link
	source  watcher.Source
	stopSrc context.CancelFunc
	k8s     *watcher.Kubernetes
	ids     map[string]uint32     // limit name -> id
	applied map[uint32]maps.Limit // what was last written, by id
	meta    map[uint32]maps.Meta
	pending map[uint32]counterSnap // counters read at the last tick
	warned  map[string]string      // limit name -> last warning logged

	reloadErrors prometheus.Counter
	reloads      prometheus.Counter
	notify       chan struct{}
	statusDue    chan struct{}
}

// Run runs the agent until ctx ends. On return the data path stays
// attached and pinned, enforcing the last shares.
func Run(ctx context.Context, opts Options) error {
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	if opts.ConfigPoll <= 0 {
		opts.ConfigPoll = 500 * time.Millisecond
	}
	cfg, err := v1alpha1.LoadConfig(opts.ConfigPath)
	if err != nil {
		return err
	}
	a := &Agent{
		opts:      opts,
		log:       opts.Log,
		links:     make(map[string]link.Link),
		ids:       make(map[string]uint32),
		applied:   make(map[uint32]maps.Limit),
		meta:      make(map[uint32]maps.Meta),
		pending:   make(map[uint32]counterSnap),
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
	}
	if err := a.start(ctx, cfg); err != nil {
		a.close()
		return err
	}
	defer a.close()

	reg := prometheus.NewRegistry()
	reg.MustRegister(a.reloadErrors, a.reloads, &collector{read: a.readStatus})
	srv, addr, err := a.serveMetrics(cfg.MetricsAddress, reg)
	if err != nil {
		return err
	}
	if srv != nil {
		defer srv.Close()
	}
	if opts.Ready != nil {
		opts.Ready(addr)
	}

	go a.watchConfig(ctx)
	if a.k8s != nil {
		go a.statusLoop(ctx)
	}
	snap := time.NewTicker(time.Second)
	defer snap.Stop()
	for {
		select {
		case <-ctx.Done():
			a.log.Info("stopping; the data path stays attached with the last shares")
			return nil
		case <-a.notify:
			a.mu.Lock()
			err := a.reconcile()
			a.mu.Unlock()
			if err != nil {
				a.log.Error("reconcile", "error", err)
			}
			select {
			case a.statusDue <- struct{}{}:
			default:
			}
		case <-snap.C:
			a.snapshot()
		}
	}
}

func (a *Agent) wake() {
	select {
	case a.notify <- struct{}{}:
	default:
	}
}

// start loads or adopts the data path, attaches it, starts the count source
// and does the first reconcile.
func (a *Agent) start(ctx context.Context, cfg *v1alpha1.Config) error {
	if err := ensureBPFFS(cfg.PinDir); err != nil {
		return err
	}
	dp, err := maps.Load(maps.Options{PinDir: cfg.PinDir, MaxBuckets: cfg.MaxBuckets})
	if err != nil {
		return err
	}
	a.dp = dp
	a.cfg = cfg
	// Adopt what an earlier agent left: names and ids from the pins.
	for _, id := range dp.IDs() {
		m, err := dp.Meta(id)
		if err != nil {
			return err
		}
		if m.Name != "" {
			a.ids[m.Name] = id
			a.meta[id] = m
		}
		if l, err := dp.Limit(id); err == nil {
			a.applied[id] = l
		}
	}
	if len(a.ids) > 0 {
		a.log.Info("adopted pinned data path", "pin_dir", cfg.PinDir, "limits", len(a.ids))
	}
	a.startSource(ctx, cfg.Count)
	if k := a.opts.Kubernetes; k != nil {
		if len(cfg.Limits) > 0 {
			return errors.New("limits: in a cluster the limits are RateLimit objects; remove them from the config file")
		}
		a.k8s = k
		go k.Run(ctx, a.wake)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.reconcile(); err != nil {
		return err
	}
	return a.attach(cfg.Interfaces)
}

// attach makes the link set match ifaces: new ones attached (or adopted),
// dropped ones detached.
func (a *Agent) attach(ifaces []string) error {
	for _, iface := range ifaces {
		if _, ok := a.links[iface]; ok {
			continue
		}
		l, err := attachXDP(a.dp.Program(), iface, a.cfg.PinDir, a.log)
		if err != nil {
			return err
		}
		a.links[iface] = l
	}
	pinned, err := pinnedLinks(a.cfg.PinDir)
	if err != nil {
		return err
	}
	for _, iface := range pinned {
		if slices.Contains(ifaces, iface) {
			continue
		}
		if l, ok := a.links[iface]; ok {
			l.Close()
			delete(a.links, iface)
		}
		if err := detachXDP(iface, a.cfg.PinDir); err != nil {
			return err
		}
		a.log.Info("detached XDP", "interface", iface)
	}
	return nil
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
	for _, l := range a.links {
		l.Close()
	}
	if a.dp != nil {
		a.dp.Close()
	}
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
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
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
func (a *Agent) reload(ctx context.Context) error {
	cfg, err := v1alpha1.LoadConfig(a.opts.ConfigPath)
	if err != nil {
		return err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	old := a.cfg
	if cfg.PinDir != old.PinDir || cfg.MaxBuckets != old.MaxBuckets {
		return errors.New("pinDir and maxBuckets take effect on restart only: restore them or restart the agent")
	}
	a.cfg = cfg
	if !reflect.DeepEqual(cfg.Count, old.Count) {
		a.startSource(ctx, cfg.Count)
	}
	if err := a.reconcile(); err != nil {
		a.cfg = old
		if !reflect.DeepEqual(cfg.Count, old.Count) {
			a.startSource(ctx, old.Count)
		}
		return err
	}
	if err := a.attach(cfg.Interfaces); err != nil {
		return err
	}
	a.log.Info("config applied", "path", a.opts.ConfigPath, "limits", len(cfg.Limits))
	return nil
}

// statusLoop writes each RateLimit's status (accepted or why not, and the
// count) after reconciles, apart from the reconcile loop: an unreachable API
// server must not hold up enforcement.
func (a *Agent) statusLoop(ctx context.Context) {
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.statusDue:
		case <-t.C:
		}
		all, invalid := a.k8s.Limits()
		for _, l := range all {
			obs := a.k8s.Observe(l.Name)
			if l.Scope != v1alpha1.ScopeNodes && l.Scope != v1alpha1.ScopeService {
				a.mu.Lock()
				obs = a.source.Observe(l.Name)
				a.mu.Unlock()
			}
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			err := a.k8s.ReportStatus(rctx, l.Name, invalid[l.Name], int32(max(obs.Replicas, 0)))
			cancel()
			if err != nil {
				a.log.Debug("RateLimit status not written", "limit", l.Name, "error", err)
			}
		}
	}
}
