package agent

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"k8s.io/client-go/rest"
	certutil "k8s.io/client-go/util/cert"

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
// /metrics (SubjectAccessReview), as the kubelet and controller-runtime's
// metrics filter ask; see reviewer for the answers and their caching.
// scrape is the handler that serves the scrapes. It returns a nil server
// when sm is off; the server runs until it is closed.
//
// Only /metrics: the probes stay on the plain listener, where the kubelet
// asks without a token.
func serveSecureMetrics(sm v1alpha1.SecureMetrics, kube *rest.Config, scrape http.Handler,
	log *slog.Logger) (*http.Server, string, error) {
	if sm.Address == "" {
		return nil, "", nil
	}
	if err := checkSecureMetrics(sm, kube); err != nil {
		return nil, "", err
	}
	tlsConfig, err := metricsTLS(sm.CertDir, log)
	if err != nil {
		return nil, "", err
	}
	rv, err := newReviewer(kube, log)
	if err != nil {
		return nil, "", err
	}
	ln, err := net.Listen("tcp", sm.Address)
	if err != nil {
		return nil, "", fmt.Errorf("secure metrics: listen on %s: %w", sm.Address, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", rv.guard(scrape))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second,
		// The reviews can take the API server's time (reviewTimeout
		// each): the answer gets theirs on top.
		ReadTimeout: metricsReadTimeout, WriteTimeout: metricsWriteTimeout + 2*reviewTimeout, IdleTimeout: metricsIdleTimeout,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)} // TLS handshake errors of scanners
	go srv.Serve(tls.NewListener(ln, tlsConfig))
	log.Info("serving metrics over TLS, to clients the API server authorizes", "address", ln.Addr().String(),
		"cert_dir", sm.CertDir)
	return srv, ln.Addr().String(), nil
}

// metricsTLS is the secure listener's TLS config: the certificate in
// certDir, read again when it changes (cert-manager renews the Secret in
// place), or a self-signed one made now.
func metricsTLS(certDir string, log *slog.Logger) (*tls.Config, error) {
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
	kp := &keyPair{cert: filepath.Join(certDir, "tls.crt"), key: filepath.Join(certDir, "tls.key"), log: log}
	if err := kp.load(); err != nil {
		return nil, fmt.Errorf("secureMetrics.certDir: %w", err)
	}
	cfg.GetCertificate = kp.get
	return cfg, nil
}

// keyPair is the certificate and key in a certDir, read again when either
// file changes (cert-manager renews a mounted Secret in place): checked at
// a handshake, at most once a second. A pair that does not load (the key
// written, the certificate not yet) keeps the last one in use.
type keyPair struct {
	cert, key string
	log       *slog.Logger

	mu      sync.Mutex
	current *tls.Certificate
	stamp   [2]time.Time // the files' modification times when read
	checked time.Time
}

func (k *keyPair) load() error {
	c, err := tls.LoadX509KeyPair(k.cert, k.key)
	if err != nil {
		return err
	}
	k.current = &c
	k.stamp = k.stamps()
	return nil
}

func (k *keyPair) stamps() [2]time.Time {
	var st [2]time.Time
	for i, f := range []string{k.cert, k.key} {
		if fi, err := os.Stat(f); err == nil {
			st[i] = fi.ModTime()
		}
	}
	return st
}

func (k *keyPair) get(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if now := time.Now(); now.Sub(k.checked) >= time.Second {
		k.checked = now
		if k.stamps() != k.stamp {
			if err := k.load(); err != nil {
				k.log.Warn("secure metrics: the certificate changed but does not load; the last one stays in use",
					"cert", k.cert, "error", err)
			} else {
				k.log.Info("secure metrics: certificate reloaded", "cert", k.cert)
			}
		}
	}
	return k.current, nil
}
