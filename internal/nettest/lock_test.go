package nettest

import (
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// lockedElsewhere reports whether another open file description (as another
// test process would have) finds the traffic lock taken.
func lockedElsewhere(t *testing.T) bool {
	t.Helper()
	f, err := os.OpenFile(TrafficLockPath, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if err == nil {
		unix.Flock(int(f.Fd()), unix.LOCK_UN)
		return false
	}
	if !errors.Is(err, unix.EWOULDBLOCK) {
		t.Fatal(err)
	}
	return true
}

// The lock is held while any holder of this process holds it, and then
// released for the other processes.
func TestHoldTraffic(t *testing.T) {
	// A lock file of its own: the machine's may be taken by another
	// package's traffic tests at any moment.
	saved := TrafficLockPath
	TrafficLockPath = t.TempDir() + "/traffic.lock"
	t.Cleanup(func() { TrafficLockPath = saved })
	if err := acquireTraffic(); err != nil {
		t.Fatal(err)
	}
	if err := acquireTraffic(); err != nil {
		t.Fatal(err)
	}
	if !lockedElsewhere(t) {
		t.Fatal("traffic lock free while held")
	}
	releaseTraffic()
	if !lockedElsewhere(t) {
		t.Fatal("traffic lock free while one holder remains")
	}
	releaseTraffic()
	if lockedElsewhere(t) {
		t.Fatal("traffic lock still held after the last holder released it")
	}
}
