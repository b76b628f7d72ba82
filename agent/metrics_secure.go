package agent

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/client-go/rest"
	certutil "k8s.io/client-go/util/cert"
	"sigs.k8s.io/controller-runtime/pkg/certwatcher"
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"

	"github.com/rlagent/rlagent/api/v1alpha1"
)

// checkSecureMetrics rejects a config with secureMetrics when there is no
// API server to check the scrapes with (kube is nil): at the start, and
// when a reload turns it on.
func checkSecureMetrics(sm v1alpha1.SecureMetrics, kube *rest.Config) error {
	if sm.Address != "" && kube == nil {
		return fmt.Errorf("secureMetrics.address: %q needs a cluster: the API server authenticates and authorizes "+
			"every scrape (run the agent in a pod or with --kubeconfig), or leave secureMetrics out", sm.Address)
	}
	return nil
}

// serveSecureMetrics serves /metrics on sm.Address over TLS, to the
// clients the API server behind kube vouches for: a bearer token it
// accepts (TokenReview) of a user who may get the non-resource URL
// /metrics (SubjectAccessReview), through controller-runtime's filter,
// whose answers are cached (1 min for a token, 5 min for an allowed and
// 30 s for a denied review). scrape is the handler that serves the
// scrapes. It returns a nil server when sm is off; the server runs until
// it is closed, the certificate watcher until ctx ends.
//
// Only /metrics: the probes stay on the plain listener, where the kubelet
// asks without a token.
func serveSecureMetrics(ctx context.Context, sm v1alpha1.SecureMetrics, kube *rest.Config, scrape http.Handler,
	log *slog.Logger) (*http.Server, string, error) {
	if sm.Address == "" {
		return nil, "", nil
	}
	if err := checkSecureMetrics(sm, kube); err != nil {
		return nil, "", err
	}
	tlsConfig, err := metricsTLS(ctx, sm.CertDir, log)
	if err != nil {
		return nil, "", err
	}
	hc, err := rest.HTTPClientFor(kube)
	if err != nil {
		return nil, "", fmt.Errorf("secure metrics: API server client: %w", err)
	}
	filter, err := filters.WithAuthenticationAndAuthorization(kube, hc)
	if err != nil {
		return nil, "", fmt.Errorf("secure metrics: %w", err)
	}
	ln, err := net.Listen("tcp", sm.Address)
	if err != nil {
		return nil, "", fmt.Errorf("secure metrics: listen on %s: %w", sm.Address, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", authnRejects401(filter, scrape, log))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second,
		// The reviews can take the API server's time (the filter gives
		// each 10 s and retries): the answer gets theirs on top.
		ReadTimeout: metricsReadTimeout, WriteTimeout: metricsWriteTimeout + 30*time.Second, IdleTimeout: metricsIdleTimeout,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)} // TLS handshake errors of scanners
	go srv.Serve(tls.NewListener(ln, tlsConfig))
	log.Info("serving metrics over TLS, to clients the API server authorizes", "address", ln.Addr().String(),
		"cert_dir", sm.CertDir)
	return srv, ln.Addr().String(), nil
}

// metricsTLS is the secure listener's TLS config: the certificate in
// certDir, read again when it changes (cert-manager renews the Secret in
// place), or a self-signed one made now.
func metricsTLS(ctx context.Context, certDir string, log *slog.Logger) (*tls.Config, error) {
	cfg := &tls.Config{
		MinVersion: tls.VersionTLS12,
		// HTTP/1.1 only, as controller-runtime's and kubebuilder's secure
		// metrics servers: HTTP/2's stream resets (CVE-2023-44487) cost
		// the server more than they cost the client, and one scrape at a
		// time needs no streams.
		NextProtos: []string{"http/1.1"},
	}
	if certDir == "" {
		host, err := os.Hostname()
		if err != nil {
			host = "rlagent"
		}
		certPEM, keyPEM, err := certutil.GenerateSelfSignedCertKey(host, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("secure metrics: self-signed certificate: %w", err)
		}
		c, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			return nil, fmt.Errorf("secure metrics: self-signed certificate: %w", err)
		}
		cfg.Certificates = []tls.Certificate{c}
		return cfg, nil
	}
	cw, err := certwatcher.New(filepath.Join(certDir, "tls.crt"), filepath.Join(certDir, "tls.key"))
	if err != nil {
		return nil, fmt.Errorf("secureMetrics.certDir: %w", err)
	}
	go func() {
		if err := cw.Start(ctx); err != nil {
			log.Error("secure metrics: watching the certificate stopped; the last one read stays in use", "cert_dir", certDir, "error", err)
		}
	}()
	cfg.GetCertificate = cw.GetCertificate
	return cfg, nil
}

// authnRejects401 puts the filter in front of next, and answers 401, not
// the filter's 500, to a token the API server did not accept: the filter
// answers 500 whenever the authentication returns an error, and a token
// the TokenReview rejects is one (the review's status.error). The API
// server itself, kube-rbac-proxy and Prometheus's reading of a 401 ("your
// credentials") agree; a 500 would send whoever looks at the scrape to the
// agent instead of to the token. An API server that cannot be asked is
// then a 401 too, as it is for the API server's own webhook authenticator;
// the log says which.
//
// The filter says that its authentication failed only in its log, so it is
// wrapped per request with a logger that notes it (a closure: cheap next
// to the reviews).
func authnRejects401(filter func(logr.Logger, http.Handler) (http.Handler, error), next http.Handler,
	log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sink := &filterLog{log: log.With("remote", r.RemoteAddr), authnFailed: new(bool)}
		h, err := filter(logr.New(sink), next)
		if err != nil {
			log.Error("secure metrics: filter", "error", err)
			http.Error(w, "Internal Server Error", http.StatusInternalServerError)
			return
		}
		h.ServeHTTP(&authnWriter{ResponseWriter: w, sink: sink}, r)
	})
}

// filterLog is the filter's logger for one request: authentication errors
// are the client's (debug, and noted for authnWriter), everything else
// goes to the agent's log as the filter says it.
type filterLog struct {
	log         *slog.Logger
	authnFailed *bool // shared with the loggers derived from this one
}

func (l *filterLog) Init(logr.RuntimeInfo) {}

// Enabled: the filter's V(4) messages (a missing token, a denied review)
// are debug.
func (l *filterLog) Enabled(level int) bool {
	return l.log.Enabled(context.Background(), slog.LevelDebug) || level == 0
}

func (l *filterLog) Info(level int, msg string, kv ...any) {
	lvl := slog.LevelInfo
	if level > 0 {
		lvl = slog.LevelDebug
	}
	l.log.Log(context.Background(), lvl, "secure metrics: "+msg, kv...)
}

func (l *filterLog) Error(err error, msg string, kv ...any) {
	// The filter's message for an error of the authentication (see
	// sigs.k8s.io/controller-runtime/pkg/metrics/filters).
	if msg == "Authentication failed" {
		*l.authnFailed = true
		l.log.Debug("secure metrics: token not accepted (401)", append(kv, "error", err)...)
		return
	}
	l.log.Warn("secure metrics: "+msg, append(kv, "error", err)...)
}

func (l *filterLog) WithValues(kv ...any) logr.LogSink {
	return &filterLog{log: l.log.With(kv...), authnFailed: l.authnFailed}
}

func (l *filterLog) WithName(name string) logr.LogSink {
	return &filterLog{log: l.log.With("logger", name), authnFailed: l.authnFailed}
}

// authnWriter turns the filter's 500 for an authentication error into 401.
type authnWriter struct {
	http.ResponseWriter
	sink      *filterLog
	rewritten bool
}

func (w *authnWriter) WriteHeader(code int) {
	if code == http.StatusInternalServerError && *w.sink.authnFailed {
		w.rewritten = true
		code = http.StatusUnauthorized
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *authnWriter) Write(p []byte) (int, error) {
	if w.rewritten {
		// The filter's "Authentication failed": the body goes with the
		// status it was written for.
		w.rewritten = false
		if _, err := w.ResponseWriter.Write([]byte("Unauthorized\n")); err != nil {
			return 0, err
		}
		return len(p), nil
	}
	return w.ResponseWriter.Write(p)
}
