package nettest

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// Traffic-sending suites of different packages must not run at the same
// time (go test runs packages in parallel): their rates and timings are
// measured, and two of them on two CPUs skew each other. Every test that
// builds a veth pair (MustPair) holds the traffic lock until its cleanup: an
// exclusive flock on a file in the temporary directory, shared by every
// test process of the machine, and counted within one process, so that the
// tests of one package (and a test that builds several pairs) hold it
// together.
var traffic struct {
	mu   sync.Mutex
	refs int
	f    *os.File
}

// TrafficLockPath is the file whose flock serializes traffic tests.
var TrafficLockPath = filepath.Join(os.TempDir(), "rlagent-test-traffic.lock")

// HoldTraffic takes the traffic lock for tb, waiting for other test
// processes to release it, and releases it in tb.Cleanup.
func HoldTraffic(tb testing.TB) {
	tb.Helper()
	if err := acquireTraffic(); err != nil {
		tb.Fatalf("traffic lock: %v", err)
	}
	tb.Cleanup(releaseTraffic)
}

func acquireTraffic() error {
	traffic.mu.Lock()
	defer traffic.mu.Unlock()
	if traffic.refs == 0 {
		f, err := os.OpenFile(TrafficLockPath, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			return err
		}
		// Blocks while another process's traffic tests run; the kernel
		// drops the lock if that process dies.
		for {
			err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
			if err != unix.EINTR {
				break
			}
		}
		if err != nil {
			f.Close()
			return fmt.Errorf("flock %s: %w", TrafficLockPath, err)
		}
		traffic.f = f
	}
	traffic.refs++
	return nil
}

func releaseTraffic() {
	traffic.mu.Lock()
	defer traffic.mu.Unlock()
	traffic.refs--
	if traffic.refs == 0 && traffic.f != nil {
		unix.Flock(int(traffic.f.Fd()), unix.LOCK_UN)
		traffic.f.Close()
		traffic.f = nil
	}
}
