package producer_test

import (
	"testing"

	"github.com/asynq-throttle/asynq-throttle/internal/doctest"
)

// README.md shows the enqueue side ("Use it in your code") and the enqueue quota's web
// handler ("Operations") as these files have them.
func TestREADMEShowsExamples(t *testing.T) {
	t.Parallel()
	doctest.ShowsFile(t, "../README.md", "example_test.go")
	doctest.ShowsFile(t, "../README.md", "quota_example_test.go")
}
