package vm

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/vmchan"
)

// qmpClient is a small QMP client over a unix socket: the greeting,
// qmp_capabilities, commands matched to their replies by id, and events.
// It is safe for concurrent use; every call takes its deadline from ctx.
type qmpClient struct {
	conn   net.Conn
	nextID atomic.Uint64

	mu      sync.Mutex
	pending map[string]chan qmpReply
	closed  chan struct{}
	err     error // why the reader stopped; set before closed is closed

	// Events receives the QMP events (buffered; dropped when full).
	Events chan qmpEvent
}

type qmpReply struct {
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
}

type qmpEvent struct {
	Event string          `json:"event"`
	Data  json.RawMessage `json:"data"`
}

type qmpMessage struct {
	qmpReply
	ID    string          `json:"id"`
	QMP   json.RawMessage `json:"QMP"`
	Event string          `json:"event"`
	Data  json.RawMessage `json:"data"`
}

// dialQMP connects to the QMP socket at path, reads the greeting and
// leaves capabilities negotiation mode.
func dialQMP(ctx context.Context, path string) (*qmpClient, error) {
	conn, err := vmchan.DialUnix(ctx, path)
	if err != nil {
		return nil, fmt.Errorf("qmp connection: %w: %w", errdefs.ErrUnavailable, err)
	}
	c := &qmpClient{conn: conn, pending: map[string]chan qmpReply{}, closed: make(chan struct{}), Events: make(chan qmpEvent, 64)}
	greeting := make(chan error, 1)
	go c.read(greeting)
	select {
	case err := <-greeting:
		if err != nil {
			_ = conn.Close()
			return nil, fmt.Errorf("qmp greeting: %w: %w", errdefs.ErrUnavailable, err)
		}
	case <-ctx.Done():
		_ = conn.Close()
		return nil, fmt.Errorf("qmp greeting: %w: %w", errdefs.ErrDeadlineExceeded, ctx.Err())
	}
	if _, err := c.Execute(ctx, "qmp_capabilities", nil); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return c, nil
}

func (c *qmpClient) read(greeting chan<- error) {
	sc := bufio.NewScanner(c.conn)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	greeted := false
	for sc.Scan() {
		var m qmpMessage
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			continue
		}
		switch {
		case m.QMP != nil && !greeted:
			greeted = true
			greeting <- nil
		case m.Event != "":
			select {
			case c.Events <- qmpEvent{Event: m.Event, Data: m.Data}:
			default:
			}
		case m.ID != "":
			c.mu.Lock()
			ch := c.pending[m.ID]
			delete(c.pending, m.ID)
			c.mu.Unlock()
			if ch != nil {
				ch <- m.qmpReply
			}
		}
	}
	err := sc.Err()
	if err == nil {
		err = fmt.Errorf("qmp socket closed by qemu")
	}
	if !greeted {
		greeting <- err
	}
	c.mu.Lock()
	c.err = err
	c.mu.Unlock()
	close(c.closed)
}

// Execute runs one QMP command and returns its "return" value.
func (c *qmpClient) Execute(ctx context.Context, cmd string, args any) (json.RawMessage, error) {
	id := fmt.Sprintf("o%d", c.nextID.Add(1))
	req := map[string]any{"execute": cmd, "id": id}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("qmp %s request: %w: %w", cmd, errdefs.ErrInternal, err)
	}
	ch := make(chan qmpReply, 1)
	c.mu.Lock()
	c.pending[id] = ch
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		delete(c.pending, id)
		c.mu.Unlock()
	}()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.conn.SetWriteDeadline(dl)
	}
	if _, err := c.conn.Write(append(b, '\n')); err != nil {
		return nil, fmt.Errorf("qmp %s: %w: %w", cmd, errdefs.ErrUnavailable, err)
	}
	select {
	case r := <-ch:
		if r.Error != nil {
			return nil, fmt.Errorf("qmp %s: %w: %s: %s", cmd, errdefs.ErrInternal, r.Error.Class, r.Error.Desc)
		}
		return r.Return, nil
	case <-c.closed:
		c.mu.Lock()
		err := c.err
		c.mu.Unlock()
		return nil, fmt.Errorf("qmp %s: %w: %w", cmd, errdefs.ErrUnavailable, err)
	case <-ctx.Done():
		return nil, fmt.Errorf("qmp %s: %w: %w", cmd, errdefs.ErrDeadlineExceeded, ctx.Err())
	}
}

// Status returns the VM's run state ("running", "paused", "prelaunch", ...).
func (c *qmpClient) Status(ctx context.Context) (string, error) {
	raw, err := c.Execute(ctx, "query-status", nil)
	if err != nil {
		return "", err
	}
	var st struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return "", fmt.Errorf("qmp query-status reply: %w: %w", errdefs.ErrInternal, err)
	}
	return st.Status, nil
}

// Done is closed when the QMP connection ends (qemu exited or closed it).
func (c *qmpClient) Done() <-chan struct{} { return c.closed }

// Close closes the connection.
func (c *qmpClient) Close() error { return c.conn.Close() }
