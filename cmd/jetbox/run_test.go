package main

import (
	"math"
	"testing"
)

// TestMemoryLimit: the default soft memory limit follows the window's bytes.
func TestMemoryLimit(t *testing.T) {
	for bytes, want := range map[int]int64{8 << 20: 40 << 20, 64 << 20: 152 << 20, 0: math.MaxInt64} {
		if got := memoryLimit(bytes); got != want {
			t.Errorf("memoryLimit(%d) = %d, want %d", bytes, got, want)
		}
	}
}
