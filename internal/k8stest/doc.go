// Package k8stest runs a real Kubernetes API server for tests: kube-apiserver
// and etcd, built from the Go module proxy (test/k8s/tools), started on
// loopback and stopped when the test ends. No fake clientset, no containers.
//
// # Binaries
//
// [EnsureBinaries] returns kube-apiserver and etcd from a per-user cache keyed
// by [KubernetesVersion] (see [CacheDir]), building them with `go build` in
// test/k8s/tools when they are missing. A cold build takes ~8 min and ~2 GB of
// RAM on two cores; afterwards the cache (and the Go build cache) make it free.
// A lock file serializes builds between test binaries that `go test ./...`
// runs in parallel; the others wait for it and then reuse its output.
// `go run ./internal/k8stest/k8sbin` does the same from the command line, which
// is how `make test-k8s` shows the build's progress before the tests start.
//
// # Lifetime
//
// [Start] gives a test its own etcd and kube-apiserver (~5 s) that t.Cleanup
// stops (SIGTERM, then SIGKILL) together with their temporary directory, also
// when the test fails; the processes' output is printed when it does. Use it
// when the test stops the API server ([Env.StopAPIServer]) or otherwise
// disturbs it.
//
// Tests that only create objects can share one Env per test binary:
//
//	func TestMain(m *testing.M) { os.Exit(k8stest.RunShared(m)) }
//
//	func TestSomething(t *testing.T) {
//		env := k8stest.Shared(t)      // started by the first caller
//		ns := env.Namespace(t)        // a fresh namespace keeps tests apart
//		...
//	}
//
// [RunShared] stops the shared Env after the last test. As a second line of
// defense every process is started with Pdeathsig=SIGKILL, so a test binary
// that panics or is killed by -timeout does not leave servers running.
//
// If the binaries cannot be built, Start and Shared skip the test with the
// reason (fail it with RLAGENT_REQUIRE_ROOT_TESTS=1, see internal/testenv).
//
// Only tests (and k8sbin) import this package.
package k8stest
