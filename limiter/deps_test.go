package limiter_test

import (
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
)

// The library's packages: what a service imports.
var libraryPackages = []string{
	"github.com/rlagent/rlagent/limiter",
	"github.com/rlagent/rlagent/limiter/httplimit",
	"github.com/rlagent/rlagent/limiter/throttle",
	"github.com/rlagent/rlagent/limiter/grpclimit",
	"github.com/rlagent/rlagent/limiter/spec",
	"github.com/rlagent/rlagent/limiter/kube",
}

// TestDependencies: a library people can import anywhere. No package of
// it imports the data path (cilium/ebpf, netlink, rlagent's maps, attach,
// agent, bpf); only grpclimit imports gRPC, so that net/http users do not;
// only kube imports client-go, so that a program without Kubernetes does
// not; only spec and kube import the API types (apimachinery), so that a
// program that sets its limits itself imports the standard library and
// prometheus' client.
func TestDependencies(t *testing.T) {
	if testing.Short() {
		t.Skip("go list: not in -short")
	}
	forbidden := []string{
		"github.com/cilium/ebpf", "github.com/vishvananda/netlink", "github.com/vishvananda/netns",
		"github.com/rlagent/rlagent/maps", "github.com/rlagent/rlagent/attach",
		"github.com/rlagent/rlagent/agent", "github.com/rlagent/rlagent/bpf",
	}
	only := map[string][]string{
		"google.golang.org/grpc": {"github.com/rlagent/rlagent/limiter/grpclimit"},
		"k8s.io/client-go":       {"github.com/rlagent/rlagent/limiter/kube"},
		"k8s.io/api":             {"github.com/rlagent/rlagent/limiter/kube"},
		// The API types: only the sources of RateLimit specs.
		"k8s.io/apimachinery": {"github.com/rlagent/rlagent/limiter/spec", "github.com/rlagent/rlagent/limiter/kube"},
	}
	for _, pkg := range libraryPackages {
		out, err := exec.Command("go", "list", "-deps", pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
		}
		deps := strings.Fields(string(out))
		for _, d := range deps {
			for _, f := range forbidden {
				if d == f || strings.HasPrefix(d, f+"/") {
					t.Errorf("%s imports %s", pkg, d)
				}
			}
			for prefix, allowed := range only {
				if (d == prefix || strings.HasPrefix(d, prefix+"/")) && !slices.Contains(allowed, pkg) {
					t.Errorf("%s imports %s: only %s may", pkg, d, allowed)
				}
			}
		}
		t.Logf("%s: %d packages in its import graph", pkg, len(deps))
	}
}

// TestCrossBuild: the library builds without cgo for linux, darwin and
// windows. The packages that do not import client-go are built for each
// (spec included: the API types and count sources it shares with the
// agent);
// kube (client-go, which builds everywhere) is left to TestDependencies,
// as its build for two more systems costs CI minutes and proves only
// client-go's portability.
func TestCrossBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("cross builds: not in -short")
	}
	var wg sync.WaitGroup
	for _, goos := range []string{"linux", "darwin", "windows"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			args := append([]string{"build"}, libraryPackages[:5]...)
			cmd := exec.Command("go", args...)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+goos, "GOARCH=amd64")
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Errorf("GOOS=%s CGO_ENABLED=0 go build: %v\n%s", goos, err, out)
			}
		}()
	}
	wg.Wait()
}
