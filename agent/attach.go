package agent

import (
	"fmt"
	"os"

	"github.com/rlagent/rlagent/attach"
	"github.com/rlagent/rlagent/maps"
)

// Cleanup detaches every hook pinned in pinDir (XDP, tcx links and clsact
// filters of ours, also in endpoints' network namespaces) and removes the
// pins: the maps, the links and the lock record. Other programs, filters
// and qdiscs stay.
func Cleanup(pinDir string) error {
	if err := checkPinPath(pinDir); err != nil { // nothing is removed through a planted link
		return fmt.Errorf("cleanup %s: %w", pinDir, err)
	}
	if err := attach.Cleanup(pinDir); err != nil {
		return fmt.Errorf("cleanup %s: %w", pinDir, err)
	}
	if err := maps.RemovePins(pinDir); err != nil {
		return fmt.Errorf("cleanup %s: %w", pinDir, err)
	}
	removeLockRecord(pinDir) // a killed agent's (see pinlock.go)
	os.Remove(pinDir)
	return nil
}
