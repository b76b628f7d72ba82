package agent

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/client-go/rest"
	certutil "k8s.io/client-go/util/cert"

	"github.com/rlagent/rlagent/api/v1alpha1"
)

// TestSecureMetricsNeedsCluster: a config with secureMetrics is rejected
// when the agent has no cluster to check the scrapes with, naming the
// field, at the start and at a reload (both load the file with
// loadConfig); in a cluster it loads.
func TestSecureMetricsNeedsCluster(t *testing.T) {
	path := filepath.Join(t.TempDir(), "rlagent.yaml")
	if err := os.WriteFile(path, []byte("interfaces: [lo]\nsecureMetrics:\n  address: \":9479\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := loadConfig(Options{ConfigPath: path, Log: quiet()})
	if err == nil || !strings.Contains(err.Error(), `secureMetrics.address: ":9479" needs a cluster`) {
		t.Errorf("without a cluster: %v; want secureMetrics.address: ... needs a cluster", err)
	}
	if _, err := loadConfig(Options{ConfigPath: path, Log: quiet(), KubeConfig: &rest.Config{Host: "https://127.0.0.1:6443"}}); err != nil {
		t.Errorf("in a cluster: %v", err)
	}
}

// TestSecureMetricsTLS: the secure listener presents the certificate in
// certDir (and a new one written there, without a restart), or a
// self-signed one; it speaks HTTP/1.1 only, serves /metrics alone, and
// answers 401 without contacting the API server to a request without a
// token. A token it cannot have reviewed (the API server is unreachable)
// is a 401 too, and says so in the log.
func TestSecureMetricsTLS(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "rlagent_test"}))
	scrape := promhttp.HandlerFor(reg, promhttp.HandlerOpts{MaxRequestsInFlight: 1})
	// Nothing listens there: every review fails.
	kube := &rest.Config{Host: "https://127.0.0.1:1", TLSClientConfig: rest.TLSClientConfig{Insecure: true}}

	dir := t.TempDir()
	writeCert := func(host string) []byte {
		t.Helper()
		certPEM, keyPEM, err := certutil.GenerateSelfSignedCertKey(host, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		// Key first: the watcher reads the pair when the certificate moves.
		if err := os.WriteFile(filepath.Join(dir, "tls.key"), keyPEM, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "tls.crt"), certPEM, 0o644); err != nil {
			t.Fatal(err)
		}
		b, _ := pem.Decode(certPEM)
		return b.Bytes
	}
	first := writeCert("first.example")

	logs := &logBuffer{} // the server's goroutines log at once
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	served := map[string]string{} // certDir: address
	for _, certDir := range []string{dir, ""} {
		srv, addr, err := serveSecureMetrics(v1alpha1.SecureMetrics{Address: "127.0.0.1:0", CertDir: certDir}, kube, scrape, log)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Close() })
		served[certDir] = addr
	}

	peer := func(addr string) *x509.Certificate {
		t.Helper()
		c, err := tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2", "http/1.1"}})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		st := c.ConnectionState()
		if st.NegotiatedProtocol == "h2" {
			t.Errorf("%s: negotiated h2; want HTTP/1.1 only", addr)
		}
		return st.PeerCertificates[0]
	}
	if got := peer(served[dir]); !bytes.Equal(got.Raw, first) {
		t.Errorf("certDir: served %s, want the certificate in tls.crt (first.example)", got.Subject)
	}
	second := writeCert("second.example")
	deadline := time.Now().Add(15 * time.Second)
	for !bytes.Equal(peer(served[dir]).Raw, second) {
		if time.Now().After(deadline) {
			t.Fatalf("certDir: the rewritten certificate was not served within 15 s")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if got := peer(served[""]); got.Issuer.CommonName == "" || got.Subject.CommonName == "first.example" {
		t.Errorf("no certDir: served %s issued by %s; want a certificate made at start", got.Subject, got.Issuer)
	}

	client := &http.Client{Timeout: time.Minute, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	get := func(url, token string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, url, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	base := "https://" + served[""]
	if code, body := get(base+"/metrics", ""); code != http.StatusUnauthorized {
		t.Errorf("no token: %d %q, want 401", code, body)
	}
	if code, _ := get(base+"/readyz", ""); code != http.StatusNotFound {
		t.Errorf("/readyz: %d, want 404: the probes are on the plain listener", code)
	}
	if code, body := get(base+"/metrics", "some-token"); code != http.StatusUnauthorized || body != "Unauthorized\n" {
		t.Errorf("a token the API server could not review: %d %q, want 401", code, body)
	}
	if logs.count("token review failed; answering 401") == 0 {
		t.Errorf("the failed review is not in the log:\n%s", logs.text())
	}
}

// The reviews' cache holds at most reviewCacheSize answers, whatever a
// stranger sends, and forgets an answer when it expires.
func TestReviewCache(t *testing.T) {
	var c cache[bool]
	for i := range 3 * reviewCacheSize {
		c.put(strconv.Itoa(i), true, true, time.Minute)
		if len(c.m) > reviewCacheSize {
			t.Fatalf("%d answers after %d puts, want at most %d", len(c.m), i+1, reviewCacheSize)
		}
	}
	last := strconv.Itoa(3*reviewCacheSize - 1)
	if _, ok, found := c.get(last); !found || !ok {
		t.Errorf("the last answer put is gone")
	}
	c.put("short", true, false, time.Millisecond)
	time.Sleep(5 * time.Millisecond)
	if _, _, found := c.get("short"); found {
		t.Errorf("an expired answer is still found")
	}
}
