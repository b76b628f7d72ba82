package k8s

import (
	"fmt"
	"os"
	"testing"

	"github.com/rlagent/rlagent/internal/agenttest"
	"github.com/rlagent/rlagent/internal/k8stest"
	"github.com/rlagent/rlagent/internal/nettest"
)

// rlagentBin is the binary under test.
var rlagentBin string

func TestMain(m *testing.M) {
	nettest.MaybeExec() // the launcher of the agents in their namespaces: never returns there
	os.Exit(run(m))
}

func run(m *testing.M) int {
	bin, cleanup, err := agenttest.Binary()
	if err != nil {
		fmt.Fprintf(os.Stderr, "k8s: %v\n", err)
		return 1
	}
	defer cleanup()
	rlagentBin = bin
	return k8stest.RunShared(m)
}
