package node

import (
	"fmt"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// A sandbox's state in the node's table. The states and the moves between
// them are these; every change of a record's state goes through transition.
//
//	creating ──start──▶ running ◀──resume── paused
//	   │                 │   └────pause────▶   │
//	pooled ──launch──▶ running                 │
//	   └─────────────┬──┴──────────────────────┘
//	                 ▼ stop (from any state; a failed stop stays stopping
//	             stopping     and the reaper retries it) ──▶ (record deleted)
const (
	stateCreating = "creating"
	// statePooled is a prestarted sandbox nobody has taken: the next node
	// start removes it (its spec is not any caller's).
	statePooled   = "pooled"
	stateRunning  = "running"
	statePaused   = "paused"
	stateStopping = "stopping"
)

// transitions lists, for each state, the states a record may move to.
var transitions = map[string][]string{
	stateCreating: {stateRunning, stateStopping},
	statePooled:   {stateCreating, stateRunning, stateStopping},
	stateRunning:  {statePaused, stateStopping},
	statePaused:   {stateRunning, stateStopping},
	stateStopping: {stateStopping},
}

// transition returns a copy of rec moved to state to, or a
// failed-precondition error naming both states when the table has no such
// move (a pause of a stopping sandbox, a resume of a running one).
func transition(rec *record, to string) (record, error) {
	for _, ok := range transitions[rec.State] {
		if ok == to {
			next := *rec
			next.State = to
			return next, nil
		}
	}
	return record{}, errdefs.New(errdefs.ErrFailedPrecondition, "sandbox %s is %s and cannot become %s%s", rec.ID, rec.State, to, advice(rec.State, to))
}

func advice(from, to string) string {
	switch {
	case from == stateStopping:
		return "; it is being stopped"
	case to == statePaused:
		return "; only a running sandbox can be paused"
	case to == stateRunning && from == stateRunning:
		return "; it already runs"
	}
	return fmt.Sprintf("; wait until it is not %s", from)
}
