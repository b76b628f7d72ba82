package e2e

import (
	"fmt"
	"os"
	"strconv"
	"testing"

	"github.com/rlagent/rlagent/internal/agenttest"
	"github.com/rlagent/rlagent/internal/nettest"
)

// rlagentBin is the binary under test.
var rlagentBin string

func TestMain(m *testing.M) {
	nettest.MaybeExec() // the launcher of the agent in its namespace: never returns there
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if v := os.Getenv("RLAGENT_E2E_GLOBAL_RATE"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil || n == 0 || n%40 != 0 {
			fmt.Fprintf(os.Stderr, "e2e: RLAGENT_E2E_GLOBAL_RATE=%q: want a multiple of 40 pkt/s\n", v)
			return 2
		}
		globalRate = n
	}
	bin, cleanup, err := agenttest.Binary()
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
		return 1
	}
	defer cleanup()
	rlagentBin = bin
	return m.Run()
}
