package runtimetest

import (
	"context"
	"testing"
	"time"
)

func contextWithTimeout(t testing.TB, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(t.Context(), d)
}
