// Command fanout is rlagent's founding example, in a service's own
// process: an HTTP API whose handler fans each published message out to
// downstream consumers, with three global limits enforced per request by
// the limiter library, each replica taking its share:
//
//   - per-source (key src-ip or custom): what each client may publish,
//     enforced by the net/http middleware (429 with Retry-After and the
//     RateLimit fields, or a wait, as the limit's onEmpty says);
//   - per-consumer (key custom, the consumer's name): what each consumer
//     may receive, drawn before each delivery (a consumer over its limit
//     is skipped for that message, or waited for);
//   - sampler (key none): the messages sampled to the log.
//
// The deliveries go through the client-side adaptive throttle: a consumer
// that refuses (429, 503, a refused connection) gets fewer attempts.
//
// The limits come from the cluster's RateLimits with unit requests and
// scope service naming this process's Service (-service; the namespace
// from POD_NAMESPACE), or from a file (-limits). See docs/library.md.
//
//	fanout -service fanout -listen :8080 -consumer billing=http://billing/ -consumer audit=http://audit/
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/rlagent/rlagent/limiter"
	"github.com/rlagent/rlagent/limiter/httplimit"
	"github.com/rlagent/rlagent/limiter/kube"
	"github.com/rlagent/rlagent/limiter/spec"
	"github.com/rlagent/rlagent/limiter/throttle"
)

// consumers is the repeatable -consumer name=url flag.
type consumers []consumer

type consumer struct {
	name, url string
	client    *http.Client
}

func (c *consumers) String() string { return fmt.Sprint(len(*c), " consumers") }

func (c *consumers) Set(v string) error {
	name, url, ok := strings.Cut(v, "=")
	if !ok || name == "" || url == "" {
		return fmt.Errorf("%q is not name=url", v)
	}
	*c = append(*c, consumer{name: name, url: url})
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "fanout:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		listen      = flag.String("listen", "127.0.0.1:8080", "the address to serve on")
		addrFile    = flag.String("addr-file", "", "write the address served on to this file once listening")
		limitsFile  = flag.String("limits", "", "read the limits from this file (count: and limits:, unit requests) instead of the cluster")
		service     = flag.String("service", "", "this process's Service: the cluster's RateLimits of scope service naming it are enforced here, divided by its ready endpoints (namespace: POD_NAMESPACE)")
		kubeconfig  = flag.String("kubeconfig", "", "kubeconfig to reach the API server outside a pod (default: the pod's own)")
		perSource   = flag.String("per-source", "fanout-per-source", "the limit of each client's publishes")
		sourceKey   = flag.String("source-key", "client", "what keys per-source: client (the connection's address) or a header name (e.g. X-API-Key)")
		perConsumer = flag.String("per-consumer", "fanout-per-consumer", "the limit of each consumer's deliveries")
		sampler     = flag.String("sampler", "fanout-sampler", "the limit of the messages sampled to the log")
		cons        consumers
	)
	flag.Var(&cons, "consumer", "a downstream consumer, name=url (repeatable)")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))

	var src limiter.Source
	var err error
	switch {
	case *limitsFile != "" && *service != "":
		return errors.New("-limits and -service: set one")
	case *limitsFile != "":
		src, err = spec.FromFile(*limitsFile, log)
	case *service != "":
		opts := kube.Options{Service: *service, Log: log}
		if *kubeconfig != "" {
			if opts.Config, err = clientcmd.BuildConfigFromFlags("", *kubeconfig); err != nil {
				return err
			}
		}
		src, err = kube.NewSource(opts)
	default:
		return errors.New("set -limits FILE or -service NAME")
	}
	if err != nil {
		return err
	}

	reg := prometheus.NewRegistry()
	l, err := limiter.New(limiter.Options{Source: src, Registerer: reg, Logger: log})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		if err := l.Run(ctx); err != nil && ctx.Err() == nil {
			log.Error("limits source stopped", "error", err)
		}
	}()

	for i := range cons {
		t, err := throttle.New(throttle.Options{})
		if err != nil {
			return err
		}
		cons[i].client = &http.Client{Timeout: 5 * time.Second, Transport: &throttle.Transport{Throttle: t}}
	}
	key := httplimit.ClientIP
	if *sourceKey != "client" {
		key = httplimit.Header(*sourceKey)
	}
	f := &fanout{consumers: cons, perConsumer: l.Set(*perConsumer), sampler: l.Set(*sampler), log: log}
	mux := http.NewServeMux()
	mux.Handle("POST /publish", httplimit.New(l.Set(*perSource), httplimit.Options{Keys: []httplimit.KeyFunc{key}})(f))
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok\n") })
	// What this replica enforces now: each limit's share and policy.
	mux.HandleFunc("GET /limits", func(w http.ResponseWriter, _ *http.Request) {
		out := map[string]any{}
		for _, name := range []string{*perSource, *perConsumer, *sampler} {
			if c, ok := l.Config(name); ok {
				out[name] = c
			}
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(out)
	})

	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	if *addrFile != "" {
		if err := os.WriteFile(*addrFile, []byte(ln.Addr().String()), 0o644); err != nil {
			return err
		}
	}
	log.Info("serving", "address", ln.Addr().String(), "consumers", len(cons))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(shutdown)
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// fanout delivers each published message to every consumer its limit
// admits.
type fanout struct {
	consumers   consumers
	perConsumer *limiter.Set
	sampler     *limiter.Set
	log         *slog.Logger
	sampled     atomic.Int64
}

// result is what a publish answers.
type result struct {
	Delivered []string          `json:"delivered"`
	Skipped   map[string]string `json:"skipped,omitempty"`
}

func (f *fanout) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	msg, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	res := result{Delivered: []string{}}
	for _, c := range f.consumers {
		// The consumer's limit, with its policy: fail skips the consumer
		// for this message, wait holds the delivery (bounded by maxWait
		// and the request's context).
		if err := f.perConsumer.Wait(r.Context(), c.name); err != nil {
			res.skip(c.name, err.Error())
			continue
		}
		if err := c.deliver(r.Context(), msg); err != nil {
			res.skip(c.name, err.Error())
			continue
		}
		res.Delivered = append(res.Delivered, c.name)
	}
	if f.sampler.Allow() {
		f.sampled.Add(1)
		f.log.Info("sample", "source", r.RemoteAddr, "bytes", len(msg), "delivered", len(res.Delivered))
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(res)
}

func (r *result) skip(name, why string) {
	if r.Skipped == nil {
		r.Skipped = make(map[string]string)
	}
	r.Skipped[name] = why
}

func (c *consumer) deliver(ctx context.Context, msg []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url, bytes.NewReader(msg))
	if err != nil {
		return err
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s answered %s", c.name, resp.Status)
	}
	return nil
}
