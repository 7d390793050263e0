// Package log builds the process's slog logger (the only place that does) and
// carries loggers in contexts with request attributes attached.
package log

import (
	"context"
	"io"
	"log/slog"
	"os"
	"strings"
)

type ctxKey struct{}

// Options configure New.
type Options struct {
	Level  string // debug, info, warn, error
	Format string // text or json
	Output io.Writer
}

// New builds a logger and installs it as slog's default.
func New(o Options) *slog.Logger {
	lvl := slog.LevelInfo
	switch strings.ToLower(o.Level) {
	case "debug":
		lvl = slog.LevelDebug
	case "warn":
		lvl = slog.LevelWarn
	case "error":
		lvl = slog.LevelError
	}
	out := o.Output
	if out == nil {
		out = os.Stderr
	}
	hopts := &slog.HandlerOptions{Level: lvl}
	var h slog.Handler = slog.NewTextHandler(out, hopts)
	if o.Format == "json" {
		h = slog.NewJSONHandler(out, hopts)
	}
	l := slog.New(h)
	slog.SetDefault(l)
	return l
}

// WithLogger returns ctx carrying l.
func WithLogger(ctx context.Context, l *slog.Logger) context.Context {
	return context.WithValue(ctx, ctxKey{}, l)
}

// G returns the logger in ctx, or slog's default.
func G(ctx context.Context) *slog.Logger {
	if l, ok := ctx.Value(ctxKey{}).(*slog.Logger); ok {
		return l
	}
	return slog.Default()
}

// SandboxID is the attribute for a sandbox ID.
func SandboxID(id string) slog.Attr { return slog.String("sandbox.id", id) }

// NodeID is the attribute for a node ID.
func NodeID(id string) slog.Attr { return slog.String("node.id", id) }

// Err is the attribute for an error.
func Err(err error) slog.Attr { return slog.Any("err", err) }
