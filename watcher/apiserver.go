package watcher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// The Service whose endpoints are the API servers: every cluster has it,
// and the API servers' own endpoint reconciler keeps its endpoints current
// in the EndpointSlice of the same name, default/kubernetes. That one object
// is all the agent reads: any other slice labelled with the Service's name
// is written by someone else (a namespace-level write), and must not widen
// every node's protect list. Whoever can update default/kubernetes itself
// can already send every in-cluster client elsewhere.
const (
	apiServerNamespace = metav1.NamespaceDefault
	apiServerService   = "kubernetes"
	apiServerSlice     = apiServerService
)

// APIServerConfig configures APIServer.
type APIServerConfig struct {
	// Host is the REST config's Host: a URL (https://10.0.0.1:6443) or
	// host[:port]; the port defaults to the scheme's (https: 443).
	Host string
	// Client, when set, means that Host is the ClusterIP of the Service
	// default/kubernetes (the in-cluster config): kube-proxy translates it
	// to an API server's own address before the packets leave the node, so
	// the addresses to follow are that Service's endpoints, read with Client
	// from the EndpointSlice the API servers write, default/kubernetes, and
	// no other. Nil: Host is what the packets carry.
	Client kubernetes.Interface
	// Resolve looks a host name up (default: the system resolver).
	Resolve func(ctx context.Context, host string) ([]netip.Addr, error)
	// ResolveEvery is how often a host name is looked up again once it
	// resolved (default 5 min). Before that, failures are retried after 1 s,
	// doubling up to 30 s.
	ResolveEvery time.Duration
	Log          *slog.Logger
}

// APIServer follows where the agent's connection to its API server really
// goes: the addresses and ports its packets carry on the wire, so that the
// agent can protect them from every limit.
//
// It has two modes. With a Client (the agent runs in a pod), it watches the
// EndpointSlice default/kubernetes, and only that object (one list and one
// watch, filtered by namespace and name, whatever the size of the cluster).
// Without one, it protects Host itself, resolving a host name at start and
// every ResolveEvery.
//
// As everywhere in this package, the last good observation is state: a
// failed watch or lookup keeps the endpoints last seen.
type APIServer struct {
	cfg  APIServerConfig
	log  *slog.Logger
	name string // host name to resolve; "" when Host is an address or in Client mode
	port uint16 // Host's port
	inf  cache.SharedIndexInformer

	mu        sync.Mutex
	endpoints []netip.AddrPort
	known     bool
	err       error
}

// NewAPIServer returns an APIServer for cfg. Run starts it.
func NewAPIServer(cfg APIServerConfig) (*APIServer, error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.ResolveEvery <= 0 {
		cfg.ResolveEvery = 5 * time.Minute
	}
	if cfg.Resolve == nil {
		cfg.Resolve = func(ctx context.Context, host string) ([]netip.Addr, error) {
			return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		}
	}
	s := &APIServer{cfg: cfg, log: cfg.Log}
	if cfg.Client != nil {
		byName := fields.OneTermEqualSelector("metadata.name", apiServerSlice).String()
		lw := cache.NewFilteredListWatchFromClient(cfg.Client.DiscoveryV1().RESTClient(), "endpointslices", apiServerNamespace,
			func(o *metav1.ListOptions) { o.FieldSelector = byName })
		s.inf = cache.NewSharedIndexInformer(lw, &discoveryv1.EndpointSlice{}, 0, cache.Indexers{})
		s.inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
			s.log.Warn("watch of the API server's endpoints failed; the last ones stand", "error", err)
		})
		return s, nil
	}
	host, port, err := splitHost(cfg.Host)
	if err != nil {
		return nil, err
	}
	s.port = port
	if a, err := netip.ParseAddr(host); err == nil {
		s.endpoints, s.known = []netip.AddrPort{netip.AddrPortFrom(a.Unmap(), port)}, true
	} else {
		s.name = host
	}
	return s, nil
}

// splitHost returns the host and port of a REST config's Host.
func splitHost(h string) (string, uint16, error) {
	raw := h
	if !strings.Contains(raw, "://") {
		raw = "https://" + raw
	}
	u, err := url.Parse(raw)
	if err != nil || u.Hostname() == "" {
		return "", 0, fmt.Errorf("API server host %q is not a URL or host:port", h)
	}
	port := u.Port()
	switch {
	case port != "":
	case u.Scheme == "http":
		port = "80"
	default:
		port = "443"
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 {
		return "", 0, fmt.Errorf("API server host %q: port %q is not in 1..65535", h, port)
	}
	return u.Hostname(), uint16(n), nil
}

// Describe says in a few words where the endpoints come from, for logs.
func (s *APIServer) Describe() string {
	switch {
	case s.inf != nil:
		return "EndpointSlice " + apiServerNamespace + "/" + apiServerSlice + " (the API servers' own)"
	case s.name != "":
		return "host " + s.name + " of the kubeconfig, resolved"
	}
	return "host of the kubeconfig"
}

// Endpoints returns the addresses and ports the API server connection
// carries, sorted, and whether they are known yet (the first read is done).
// Known with no endpoints means the source lists none.
func (s *APIServer) Endpoints() ([]netip.AddrPort, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.endpoints), s.known
}

// Err returns the last error looking the host name up, nil once a lookup
// works again. (A failed watch of the EndpointSlices is logged; client-go
// retries it.)
func (s *APIServer) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// Run follows the endpoints until ctx ends, calling notify (never
// concurrently) after the first read and after every change.
func (s *APIServer) Run(ctx context.Context, notify func()) {
	switch {
	case s.inf != nil:
		s.runSlices(ctx, notify)
	case s.name != "":
		s.runResolve(ctx, notify)
	default:
		// A fixed address: known from the start.
		notify()
		<-ctx.Done()
	}
}

func (s *APIServer) runSlices(ctx context.Context, notify func()) {
	kick := make(chan struct{}, 1)
	poke := func(any) {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	s.inf.AddEventHandler(handler(poke))
	go s.inf.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), s.inf.HasSynced) {
		return
	}
	for {
		eps := sliceEndpoints(s.inf.GetStore().List())
		if s.set(eps, nil) {
			notify()
		}
		select {
		case <-ctx.Done():
			return
		case <-kick:
		}
	}
}

// sliceEndpoints returns every address and TCP port of the API servers'
// slice, default/kubernetes, sorted and without duplicates; other slices
// among objs count for nothing (the watch selects that one by name
// already). Every endpoint counts, ready or not: a connection that is
// already open keeps going to an endpoint that is terminating.
func sliceEndpoints(objs []any) []netip.AddrPort {
	var out []netip.AddrPort
	for _, obj := range objs {
		sl, ok := obj.(*discoveryv1.EndpointSlice)
		if !ok || sl.Namespace != apiServerNamespace || sl.Name != apiServerSlice || sl.AddressType == discoveryv1.AddressTypeFQDN {
			continue
		}
		var ports []uint16
		for _, p := range sl.Ports {
			if p.Port == nil || *p.Port < 1 || *p.Port > 65535 || (p.Protocol != nil && *p.Protocol != corev1.ProtocolTCP) {
				continue
			}
			ports = append(ports, uint16(*p.Port))
		}
		for _, e := range sl.Endpoints {
			for _, a := range e.Addresses {
				addr, err := netip.ParseAddr(a)
				if err != nil {
					continue
				}
				for _, p := range ports {
					out = append(out, netip.AddrPortFrom(addr.Unmap(), p))
				}
			}
		}
	}
	slices.SortFunc(out, func(a, b netip.AddrPort) int { return a.Compare(b) })
	return slices.Compact(out)
}

// runResolve looks the host name up at start, retrying a failure after 1 s
// (or ResolveEvery if shorter) doubling to 30 s until it first resolves, and
// then every ResolveEvery.
func (s *APIServer) runResolve(ctx context.Context, notify func()) {
	backoff := min(time.Second, s.cfg.ResolveEvery)
	for {
		wait := s.cfg.ResolveEvery
		if err := s.resolve(ctx, notify); err != nil {
			if ctx.Err() != nil {
				return
			}
			if _, known := s.Endpoints(); !known {
				wait, backoff = backoff, min(2*backoff, 30*time.Second)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// resolve looks the host name up once and records the result.
func (s *APIServer) resolve(ctx context.Context, notify func()) error {
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	addrs, err := s.cfg.Resolve(rctx, s.name)
	cancel()
	if err == nil && len(addrs) == 0 {
		err = errors.New("no addresses")
	}
	if err != nil {
		err = fmt.Errorf("resolve API server host %s: %w", s.name, err)
		if ctx.Err() == nil {
			s.log.Warn("API server host does not resolve; the last addresses stand", "error", err)
		}
		s.set(nil, err)
		return err
	}
	eps := make([]netip.AddrPort, 0, len(addrs))
	for _, a := range addrs {
		eps = append(eps, netip.AddrPortFrom(a.Unmap(), s.port))
	}
	slices.SortFunc(eps, func(a, b netip.AddrPort) int { return a.Compare(b) })
	if s.set(slices.Compact(eps), nil) {
		notify()
	}
	return nil
}

// set records a read: eps when err is nil, else only err (the endpoints
// stand). It reports whether the endpoints changed or became known.
func (s *APIServer) set(eps []netip.AddrPort, err error) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.err = err
	if err != nil {
		return false
	}
	changed := !s.known || !slices.Equal(s.endpoints, eps)
	s.endpoints, s.known = eps, true
	return changed
}
