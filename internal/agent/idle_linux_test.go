package agent

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

func TestNewIdleTrimConfig(t *testing.T) {
	for _, tc := range []struct {
		after time.Duration
		want  time.Duration // 0: disabled
	}{
		{0, DefaultIdleTrimAfter},
		{time.Second, time.Second},
		{-1, 0},
	} {
		a, err := New(t.Context(), Config{IdleTrimAfter: tc.after, EtcDir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		var got time.Duration
		if a.idle != nil {
			got = a.idle.after
			// The trimmer must see the agent's requests.
			rec := httptest.NewRecorder()
			a.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/envs", nil))
			a.idle.mu.Lock()
			dirty := a.idle.dirty
			a.idle.mu.Unlock()
			if rec.Code != http.StatusOK || !dirty {
				t.Errorf("IdleTrimAfter %s: GET /envs = %d, counted as work %t; want 200, true", tc.after, rec.Code, dirty)
			}
		}
		a.Close()
		if got != tc.want {
			t.Errorf("IdleTrimAfter %s: trimmer after %s; want %s", tc.after, got, tc.want)
		}
	}
}
