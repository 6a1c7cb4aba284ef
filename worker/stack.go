package worker

// handlerStack is the stack a throttled task's handler goroutine is grown to, once, by
// growStack before the limiter call: 16 KB. asynq runs each task's handler on a goroutine
// of its own, started with a small stack (2-8 KB, the runtime's running average), and the
// limiter call is deep: the middleware's frames, then go-redis's command, hook, retry and
// pool layers down to the socket, about 10 KB in all with go-redis v9.23. Grown a frame at
// a time, the stack was copied 2 to 3 times per task, each copy walking and adjusting every
// frame on it at the time, the last one some 40 frames deep: about 5 us of CPU per task in
// BenchmarkMiddleware_Drain, a fifth of what the middleware cost there. Grown once while
// the goroutine is still shallow, it is copied once, with a handful of frames on it. A
// goroutine that needs more (a deep handler) still grows as it would have.
const handlerStack = 16 << 10

// growHeadroom is handlerStack less growStack's frame: room for the runtime's stack guard
// (928 bytes on linux/amd64) and the frames already on the stack (asynq's and the
// middleware's, about 2 KB), so that the runtime, which doubles the stack until the frame
// fits, stops at handlerStack and not at twice that.
const growHeadroom = 4 << 10

// growIndex keeps growStack's array from being optimized away: it is only read (a
// shared variable that goroutines wrote would be a data race).
var growIndex int

// growStack makes the runtime grow the calling goroutine's stack to handlerStack now, while
// it is shallow: its frame is that large, so the runtime's check on entry finds the stack
// too small and copies it, once, to a size that fits the frame. It changes nothing else;
// its result is a byte of the array, always 0, for the caller to drop.
//
//go:noinline
func growStack() byte {
	var b [handlerStack - growHeadroom]byte
	return b[growIndex]
}
