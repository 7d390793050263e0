package node

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// record is one sandbox in the node's table, as stored on disk.
type record struct {
	ID        string         `json:"id"`
	RequestID string         `json:"request_id,omitempty"`
	Backend   string         `json:"backend"`
	Spec      specRecord     `json:"spec"`
	State     string         `json:"state"` // creating, pooled, running, paused, stopping
	CreatedAt time.Time      `json:"created_at"`
	ExpiresAt time.Time      `json:"expires_at"`
	StateDir  string         `json:"state_dir"`
	Handle    runtime.Handle `json:"handle"`
	// PausedAt is when a paused sandbox was paused (zero otherwise): its
	// lifetime clock stopped there.
	PausedAt time.Time `json:"paused_at,omitzero"`
	// PausedFilesystem: the pause kept only the sandbox's files (its
	// processes ended, its memory and its CPU and memory reservation were
	// given back); a resume starts it again on them.
	PausedFilesystem bool `json:"paused_filesystem,omitempty"`
	// FromPool: the create took a prestarted sandbox from the warm pool.
	FromPool bool `json:"from_warm_pool,omitempty"`
	// Owner is the principal that created the sandbox, Project its project
	// (empty until projects exist); see owner.go. Records from before
	// owners have neither: only admins see them.
	Owner   string `json:"owner,omitempty"`
	Project string `json:"project,omitempty"`
	// ImageID is the content ID of the image the sandbox was made from
	// (empty for records from before it was kept, and for test images):
	// a fork must have the same lower layers under the copied upper.
	ImageID string `json:"image_id,omitempty"`
	// ParentID is the sandbox this one was forked from (empty for one
	// made from an image).
	ParentID string `json:"parent_id,omitempty"`
	// MemoryPreserved: a fork that resumed its parent's memory; false for
	// one that has only its files. SourceFrozen is how long the fork's
	// parent was frozen while it was copied.
	MemoryPreserved bool          `json:"memory_preserved,omitempty"`
	SourceFrozen    time.Duration `json:"source_frozen_ns,omitempty"`
}

// specRecord is the caller's spec with defaults applied. Its JSON is the
// table's format (sandboxspec keeps the field names records were written
// with).
type specRecord = sandboxspec.Spec

var (
	bucketSandboxes = []byte("sandboxes")
	bucketRequests  = []byte("requests")
)

// table is the durable sandbox table (bbolt). Every state change is written
// before it is acted on, so a node killed at any point can finish or undo the
// work at its next start.
type table struct {
	db *bolt.DB
}

func openTable(dir string) (*table, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("make node state dir: %w", err)
	}
	path := filepath.Join(dir, "sandboxes.db")
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, errdefs.New(errdefs.ErrUnavailable, "open sandbox table %s: %w (is another opendsec-node running with this data dir?)", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketSandboxes, bucketRequests} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("init sandbox table: %w", err)
	}
	// Concurrent puts (the creates of a batch, each recorded creating and
	// then running) share a commit and its two fdatasyncs: a put still
	// returns only once its record is on disk.
	db.MaxBatchDelay = 2 * time.Millisecond
	return &table{db: db}, nil
}

func (t *table) close() error { return t.db.Close() }

func (t *table) put(r *record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("encode sandbox record: %w", err)
	}
	// Batch: fn may run more than once (it is idempotent); it returns
	// after the commit, as Update does.
	return t.db.Batch(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketSandboxes).Put([]byte(r.ID), b); err != nil {
			return err
		}
		if r.RequestID != "" {
			return tx.Bucket(bucketRequests).Put([]byte(r.RequestID), []byte(r.ID))
		}
		return nil
	})
}

// putAll writes many records in one transaction (one fsync): a batch pause
// of a whole task costs one disk write, not one per sandbox.
func (t *table) putAll(rs []*record) error {
	if len(rs) == 0 {
		return nil
	}
	bs := make([][]byte, len(rs))
	for i, r := range rs {
		b, err := json.Marshal(r)
		if err != nil {
			return fmt.Errorf("encode sandbox record: %w", err)
		}
		bs[i] = b
	}
	return t.db.Update(func(tx *bolt.Tx) error {
		for i, r := range rs {
			if err := tx.Bucket(bucketSandboxes).Put([]byte(r.ID), bs[i]); err != nil {
				return err
			}
		}
		return nil
	})
}

func (t *table) delete(r *record) error {
	return t.db.Update(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketSandboxes).Delete([]byte(r.ID)); err != nil {
			return err
		}
		if r.RequestID != "" {
			return tx.Bucket(bucketRequests).Delete([]byte(r.RequestID))
		}
		return nil
	})
}

func (t *table) all() ([]*record, error) {
	var out []*record
	err := t.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSandboxes).ForEach(func(k, v []byte) error {
			r := new(record)
			if err := json.Unmarshal(v, r); err != nil {
				return fmt.Errorf("decode sandbox record %s: %w", k, err)
			}
			out = append(out, r)
			return nil
		})
	})
	return out, err
}
