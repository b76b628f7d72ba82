// Package spec is the limiter library's Source of RateLimit specs divided
// by a replica count: limits given in code (FromLimits), read from a file
// (FromFile), or the cluster's RateLimit objects (package limiter/kube,
// built on Source). A package of its own so that a program that sets its
// limits with limiter.Limiter.Apply imports nothing of the API types.
package spec

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rlagent/rlagent/api/v1alpha1"
	"github.com/rlagent/rlagent/divide"
	"github.com/rlagent/rlagent/limiter"
	"github.com/rlagent/rlagent/watcher/count"
)

// The sources of limits: RateLimit specs (given in code, read from a file,
// or the cluster's RateLimit objects, package limiter/kube) divided by a
// replica count that a count.Source reports. The node agent's Watch and Divide, not a copy:
// the same count sources (static, file, Kubernetes), the same rule that
// the last count stands while its source is unreachable (only its age
// grows), and the same division (divide.Evenly: rate / count, the burst
// likewise with a floor of 1, a count below 1 taken as 1).
//
// Only limits with unit requests are a process's: the others are the node
// agent's, and a source leaves them out.

// Source is a limiter.Source of RateLimit specs divided by a replica count: the
// one path from a spec to a limiter.LimitConfig, under FromLimits, FromFile and
// package limiter/kube (the cluster's RateLimits). Its fields are set
// before Run and not changed after.
type Source struct {
	// Limits returns the limits now, and the reasons some are invalid
	// (those are not enforced). (Required)
	Limits func() ([]v1alpha1.Limit, map[string]error)
	// Count reports each limit's replica count. (Required)
	Count count.Source
	// Service is, in a cluster, the process's Service (namespace/name):
	// the limits of scope service that name it are this process's, and no
	// others. "": a file or limits in code (scope static).
	Service string
	// Synced reports whether Count has its first picture of the world:
	// until then nothing is applied, so that a process never takes a whole
	// global rate for lack of a count. (Optional) nil: at once.
	Synced func() bool
	// Log logs the limits this process does not enforce, and why.
	// (Optional) nil: slog.Default().
	Log *slog.Logger

	mu      sync.Mutex
	skips   map[string]string     // name: why it is not enforced here, as last logged
	applied []limiter.LimitConfig // what Run last applied
}

// Run runs the count source and calls apply with every limit's config
// whenever the limits or a count change, until ctx ends.
func (s *Source) Run(ctx context.Context, apply func([]limiter.LimitConfig)) error {
	wake := make(chan struct{}, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.Count.Run(ctx, func() {
			select {
			case wake <- struct{}{}:
			default:
			}
		})
	}()
	first := true
	for {
		if s.Synced == nil || s.Synced() {
			cfgs := s.configs()
			s.mu.Lock()
			changed := first || !slices.Equal(cfgs, s.applied)
			s.applied = cfgs
			s.mu.Unlock()
			if changed {
				apply(cfgs)
				first = false
			}
		}
		select {
		case <-ctx.Done():
			<-done
			return nil
		case <-wake:
		}
	}
}

func sortedNames[V any](m map[string]V) []string {
	names := make([]string, 0, len(m))
	for n := range m {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// configs divides every limit this process enforces by its count, sorted
// by name.
func (s *Source) configs() []limiter.LimitConfig {
	limits, invalid := s.Limits()
	var out []limiter.LimitConfig
	skips := make(map[string]string)
	for i := range limits {
		l := &limits[i]
		if l.Unit != v1alpha1.UnitRequests {
			continue // the node agent's
		}
		if err := invalid[l.Name]; err != nil {
			skips[l.Name] = "invalid: " + err.Error()
			continue
		}
		cfg, why := s.config(l)
		if why != "" {
			skips[l.Name] = why
			continue
		}
		out = append(out, cfg)
	}
	slices.SortFunc(out, func(a, b limiter.LimitConfig) int { return strings.Compare(a.Name, b.Name) })
	s.logSkips(skips)
	return out
}

// config is one limit's config at this process, or why this process does
// not enforce it.
func (s *Source) config(l *v1alpha1.Limit) (limiter.LimitConfig, string) {
	switch {
	case l.Scope == v1alpha1.ScopeService && s.Service == "":
		return limiter.LimitConfig{}, "scope service needs the cluster's source (package limiter/kube)"
	case l.Scope == v1alpha1.ScopeService && l.Match.Service != s.Service:
		return limiter.LimitConfig{}, fmt.Sprintf("divided by the endpoints of Service %s, and this process is one of %s", l.Match.Service, s.Service)
	case l.Scope != v1alpha1.ScopeService && s.Service != "":
		return limiter.LimitConfig{}, fmt.Sprintf("scope %s has no count in a cluster: a limit of a Service's processes has scope service", l.Scope)
	}
	obs := s.Count.Observe(l.Name)
	burst := l.EffectiveBurst()
	share := divide.Evenly(l.Rate, burst, obs.Replicas)
	cfg := limiter.LimitConfig{
		Name:        l.Name,
		Rate:        float64(share.Rate),
		Burst:       int64(min(share.Burst, 1<<62)),
		Keyed:       l.Key != v1alpha1.KeyNone,
		OnEmpty:     limiter.OnEmptyFail,
		Shadow:      l.Action == v1alpha1.ActionShadow,
		GlobalRate:  l.Rate,
		GlobalBurst: burst,
		Replicas:    share.Divisor,
	}
	if l.OnEmpty == v1alpha1.OnEmptyWait {
		cfg.OnEmpty = limiter.OnEmptyWait
		cfg.MaxWait = v1alpha1.DefaultMaxWait
		if l.MaxWait != nil {
			cfg.MaxWait = l.MaxWait.Duration
		}
	}
	return cfg, ""
}

// logSkips logs, once per reason, the limits with unit requests that this
// process does not enforce.
func (s *Source) logSkips(skips map[string]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, name := range sortedNames(skips) {
		if s.skips[name] != skips[name] {
			s.logger().Warn("limit not enforced by this process", "limit", name, "reason", skips[name])
		}
	}
	s.skips = skips
}

func (s *Source) logger() *slog.Logger {
	if s.Log == nil {
		return slog.Default()
	}
	return s.Log
}

// CountAge is how old the count behind a limit is (0 for a static one).
func (s *Source) CountAge(limit string) time.Duration {
	return s.Count.Observe(limit).Age(time.Now())
}

var _ interface {
	limiter.Source
	limiter.CountAger
} = (*Source)(nil)

// FromLimits is a Source of limits given in code, each with unit requests
// and scope static, shared by a fixed number of processes (replicas). The
// limits are defaulted and validated as the agent's config file is: an
// invalid one is an error that names the field.
func FromLimits(replicas int, limits ...v1alpha1.Limit) (*Source, error) {
	if replicas < 0 {
		return nil, fmt.Errorf("spec: replicas %d: 0 or more (0 is treated as 1)", replicas)
	}
	f := &v1alpha1.LimitsFile{Limits: slices.Clone(limits)}
	n := int32(min(replicas, 1<<31-1))
	f.Count.Static = &n
	f.Default()
	if err := f.Validate(); err != nil {
		return nil, fmt.Errorf("spec: %w", err)
	}
	return fileSource(f, slog.Default()), nil
}

// FromFile is a Source of the limits in a file (v1alpha1.LimitsFile: the
// count and the limits, each with unit requests and scope static), read
// once, strictly: every problem is an error that names the field. A count
// in a count file (count.file) is watched as the agent watches it: a
// missing or malformed file keeps the last count.
func FromFile(path string, log *slog.Logger) (*Source, error) {
	data, err := v1alpha1.ReadConfigFile(path)
	if err != nil {
		return nil, fmt.Errorf("spec: %w", err)
	}
	f, err := v1alpha1.ParseLimitsFile(data)
	if err != nil {
		return nil, fmt.Errorf("spec: read limits %s: %w", path, err)
	}
	if log == nil {
		log = slog.Default()
	}
	return fileSource(f, log), nil
}

func fileSource(f *v1alpha1.LimitsFile, log *slog.Logger) *Source {
	limits := slices.Clone(f.Limits)
	s := &Source{
		Limits: func() ([]v1alpha1.Limit, map[string]error) { return limits, nil },
		Log:    log,
	}
	if f.Count.Static != nil {
		s.Count = count.NewStatic(int(*f.Count.Static))
	} else {
		file := count.NewFile(f.Count.File, 0, log)
		s.Count = file
		// After the first read, good or not (a count file that cannot be
		// read at start gives count 1, as the agent's does).
		s.Synced = func() bool { o := file.Observe(""); return !o.At.IsZero() || o.Err != nil }
	}
	return s
}
