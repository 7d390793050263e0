package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/vmchan"
)

// agentPortName is the virtio-serial port the host's vm backend reaches the agent on.
const agentPortName = "agent"

// findPort returns the device node (/dev/vportNpM) of the virtio-serial port
// called name, waiting until the driver has probed it or ctx ends.
func findPort(ctx context.Context, sysDir, devDir, name string) (string, error) {
	wait := 5 * time.Millisecond
	for {
		if p := portNode(sysDir, devDir, name); p != "" {
			return p, nil
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return "", fmt.Errorf("virtio-serial port %q: %w: not under %s (is virtio_console loaded and the port on the qemu command line?): %w",
				name, errdefs.ErrNotFound, sysDir, ctx.Err())
		case <-t.C:
		}
		wait = min(2*wait, 100*time.Millisecond)
	}
}

// portNode is the device of the port called name under sysDir
// (/sys/class/virtio-ports/<vportNpM>/name), or "".
func portNode(sysDir, devDir, name string) string {
	ms, _ := filepath.Glob(filepath.Join(sysDir, "*", "name"))
	for _, m := range ms {
		b, err := os.ReadFile(m)
		if err == nil && strings.TrimSpace(string(b)) == name {
			dev := filepath.Join(devDir, filepath.Base(filepath.Dir(m)))
			if _, err := os.Stat(dev); err == nil {
				return dev
			}
		}
	}
	return ""
}

// waitHealthy does GET /health on the agent's unix socket until it answers
// 204 or ctx ends.
func waitHealthy(ctx context.Context, sock string) error {
	hc := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
		DisableKeepAlives: true,
	}}
	wait := 5 * time.Millisecond
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent/health", nil)
		if err != nil {
			return fmt.Errorf("agent health: %w: %w", errdefs.ErrInternal, err)
		}
		resp, err := hc.Do(req)
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusNoContent {
				return nil
			}
			err = fmt.Errorf("status %d", resp.StatusCode)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("agent health on %s: %w: %w (last: %w)", sock, errdefs.ErrUnavailable, ctx.Err(), err)
		case <-t.C:
		}
		wait = min(2*wait, 100*time.Millisecond)
	}
}

// bridge accepts streams on l and proxies each to the agent's unix socket
// until l is closed.
func bridge(l net.Listener, sock string) error {
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return fmt.Errorf("agent port accept: %w", err)
		}
		go proxy(c, sock)
	}
}

// identityReq is how a connection whose first request is the identity
// route starts; it is as long as HTTP/2's preface, so a peek for it never
// waits on a client that sent less.
const identityReq = "POST " + vmchan.IdentityPath + " "

// proxy copies between one host stream and one agent connection, passing on
// each direction's end as a half close. A stream whose first request is
// POST vmchan.IdentityPath is the init's own (serveIdentity).
func proxy(c net.Conn, sock string) {
	defer func() { _ = c.Close() }()
	br := bufio.NewReaderSize(c, 4096)
	if head, err := br.Peek(len(identityReq)); err != nil {
		return
	} else if string(head) == identityReq {
		serveIdentity(br, c)
		return
	} else if strings.HasPrefix(string(head), balloonReq) {
		serveBalloon(br, c)
		return
	}
	a, err := net.Dial("unix", sock)
	if err != nil {
		logf("agent dial: " + err.Error())
		return
	}
	defer func() { _ = a.Close() }()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, _ = io.Copy(a, br)
		if cw, ok := a.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
	}()
	_, _ = io.Copy(c, a)
	// The agent is done: yamux's Close is a FIN, the host sees EOF.
	_ = c.Close()
	wg.Wait()
}

// balloonReq starts a connection whose first request is the balloon route
// (shorter than identityReq: the peek above has it whole).
const balloonReq = "POST " + vmchan.BalloonPath + " "

// serveBalloon answers one POST vmchan.BalloonPath: 204 once the balloon
// driver is bound or unbound as asked, 404 without a balloon device.
func serveBalloon(br *bufio.Reader, c net.Conn) {
	req, err := http.ReadRequest(br)
	if err != nil {
		return
	}
	var b vmchan.Balloon
	code, msg := http.StatusNoContent, ""
	if err := json.NewDecoder(io.LimitReader(req.Body, 1<<12)).Decode(&b); err != nil {
		code, msg = http.StatusBadRequest, "balloon body: "+err.Error()
	} else if err := setBalloon(virtioSys, b.FreePageReporting); errors.Is(err, os.ErrNotExist) {
		code, msg = http.StatusNotFound, err.Error()
	} else if err != nil {
		code, msg = http.StatusInternalServerError, err.Error()
		logf("balloon: " + msg)
	}
	writeResponse(c, code, msg)
}

// virtioSys is the virtio bus in sysfs.
const virtioSys = "/sys/bus/virtio"

// virtioIDBalloon is the balloon's virtio device ID.
const virtioIDBalloon = "0x0005"

// setBalloon binds (on) or unbinds the virtio_balloon driver of the
// balloon device under sys; binding again what is bound (or unbinding
// what is not) changes nothing. A missing device is os.ErrNotExist.
func setBalloon(sys string, on bool) error {
	devs, _ := filepath.Glob(filepath.Join(sys, "devices", "*", "device"))
	name := ""
	for _, d := range devs {
		if b, err := os.ReadFile(d); err == nil && strings.TrimSpace(string(b)) == virtioIDBalloon {
			name = filepath.Base(filepath.Dir(d))
			break
		}
	}
	if name == "" {
		return fmt.Errorf("balloon: no virtio balloon device under %s: %w", sys, os.ErrNotExist)
	}
	drv := filepath.Join(sys, "drivers", "virtio_balloon")
	_, err := os.Lstat(filepath.Join(drv, name))
	bound := err == nil
	if bound == on {
		return nil
	}
	op := "unbind"
	if on {
		op = "bind"
	}
	if err := os.WriteFile(filepath.Join(drv, op), []byte(name), 0o200); err != nil {
		return fmt.Errorf("balloon %s %s: %w", op, name, err)
	}
	return nil
}

// writeResponse writes a one-shot HTTP response with msg as its body.
func writeResponse(c net.Conn, code int, msg string) {
	resp := &http.Response{StatusCode: code, ProtoMajor: 1, ProtoMinor: 1, Close: true, Header: http.Header{}}
	if msg != "" {
		resp.Header.Set("Content-Type", "text/plain; charset=utf-8")
		resp.Body = io.NopCloser(strings.NewReader(msg + "\n"))
		resp.ContentLength = int64(len(msg) + 1)
	}
	_ = resp.Write(c)
}

// serveIdentity answers one POST vmchan.IdentityPath: 204 once applied,
// 400 for a body that is no Identity, 500 naming what failed.
func serveIdentity(br *bufio.Reader, c net.Conn) {
	req, err := http.ReadRequest(br)
	if err != nil {
		return
	}
	var id vmchan.Identity
	code, msg := http.StatusNoContent, ""
	if err := json.NewDecoder(io.LimitReader(req.Body, 1<<16)).Decode(&id); err != nil {
		code, msg = http.StatusBadRequest, "identity body: "+err.Error()
	} else if err := applyIdentity(id); err != nil {
		code, msg = http.StatusInternalServerError, err.Error()
		logf("identity: " + msg)
	}
	writeResponse(c, code, msg)
}

// serveAgentPort finds the "agent" port, waits until the agent answers on
// sock, serves the bridge and prints the ready line on the console.
func serveAgentPort(ctx context.Context, sock string) error {
	fctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	dev, err := findPort(fctx, "/sys/class/virtio-ports", "/dev", agentPortName)
	if err != nil {
		return err
	}
	if err := waitHealthy(fctx, sock); err != nil {
		return err
	}
	l, err := vmchan.Listen(ctx, dev)
	if err != nil {
		return err
	}
	logf("agent ready")
	return bridge(l, sock)
}
