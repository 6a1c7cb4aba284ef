package worker_test

import (
	"testing"

	"github.com/asynq-throttle/asynq-throttle/internal/doctest"
)

// README.md's "Use it in your code" shows the server side as example_test.go has it, and
// "Upstream backpressure and pauses" the handler of backpressure_example_test.go.
func TestREADMEShowsExample(t *testing.T) {
	t.Parallel()
	doctest.ShowsFile(t, "../README.md", "example_test.go")
	doctest.ShowsFile(t, "../README.md", "backpressure_example_test.go")
}
