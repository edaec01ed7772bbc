"""Component IDs, in one place so the layout, the callbacks and the tests cannot drift apart."""

# controls
MODEL = "model"
COSTS = "costs"
DEVICE = "device"
DEVICE_NOTE = "device-note"  # why the device menu is off (costs measured here)
METHOD = "method"
STEP_OPTS = "step-switches"  # dcc.Checklist of app.state.STEP_OPTIONS: what the step holds
OFFLOAD = "offload-switch"  # dcc.Checklist: ["on"] re-solves with the Studio's offload method
BUDGET = "budget"  # dcc.Slider, % of the store-all peak
BUDGET_BYTES = "budget-bytes"
BUDGET_INPUT = "budget-input"  # typed budget (% of the store-all peak), commits on Enter or blur
BUDGET_MESSAGE = "budget-message"  # why a typed budget was refused, with the minimum
NUMBERS = "numbers"  # the budget card: its data-for is the plan its numbers are for
BUDGET_HINT = "budget-hint"  # what sets this model's peak (e.g. parameter gradients)

# the Hugging Face architectures menu (app.architectures): an architecture at a shape, planned
# for a GPU preset
ARCH = "arch"
ARCH_BATCH = "arch-batch"
ARCH_SEQ = "arch-seq"
ARCH_DEVICE = "arch-device"
ARCH_PLAN = "arch-plan"
ARCH_NOTE = "arch-note"  # the chosen architecture's published numbers
ARCH_ERROR = "arch-error"  # a shape out of range, or transformers missing
ARCH_FIT = "arch-fit"  # will it fit, in words, when the plan on screen is the menu's (a view)

# background work
PROGRESS = "progress"
PROGRESS_BAR = "progress-bar"
PROGRESS_TEXT = "progress-text"
CANCEL = "cancel"
CANCEL_NOTE = "cancel-note"  # after cancel: the controls went back to what the page shows

# stores
CONTEXT = "context"  # the analysed problem and method the page shows: key, minimum budget
PLAN = "plan"  # the plan on screen: key, method, budget bytes
STEP = "step"  # the step-through position (program index), or None

# messages
ERROR = "error"
PLAN_ERROR = "plan-error"  # an impossible budget, in plain words
STARTUP_ERROR = "startup-error"

# numbers
PEAK = "num-peak"
OVERHEAD = "num-overhead"
RECOMPUTED = "num-recomputed"
SOLVE_TIME = "num-solve-time"
HOST = "num-host"  # bytes parked in host memory at once (offloading plans)
NATIVE_PEAK = "num-native-peak"  # the plan's peak run natively (`core.lower`)

# views
INTRO = "intro"
GRAPH = "graph"
GRAPH_CARD = "graph-card"  # wraps the graph: its data-for is the analysis it shows
GRAPH_LEGEND = "graph-legend"
DEVICES_N = "devices-n"  # how many devices: the parallel layouts' card
PARALLEL_CARD = "parallel-card"  # data-for / data-devices: what its content was drawn for
PARALLEL_FIG = "parallel-fig"
PARALLEL_TEXT = "parallel-text"
GRAPH_OPEN = "graph-open"  # the blocks opened into their ops in the block graph
GRAPH_HOVER = "graph-hover"  # the op under the mouse in the block graph
BLOCK_PANEL = "block-panel"
TIMELINE = "timeline"
TENSORS = "tensors"  # the per-tensor view: each live storage a band over program steps
ARENA = "arena"  # the address-by-time view: each storage at its offset in one arena
PEAK_LIST = "peak-list"  # what is alive at the step, largest first (at the peak)
TRADEOFF = "tradeoff"
TRADEOFF_NOTE = "tradeoff-note"  # what the dashed curve is, or that it is being computed
TRANSFER_LANE = "transfer-lane"  # the lane's section, shown only with offloading on
TRANSFERS = "transfers"  # the transfer lane: copies and stalls on a time axis

# measure here: the plan's real step on this machine, over the prediction
MEASURE = "measure"
MEASURED = "measured"  # store: the plan measured and its live bytes per step
MEASURE_TEXT = "measure-text"

# will it fit: the whole training footprint against the device's memory
FIT = "fit"
FIT_TEXT = "fit-text"  # the answer in words, with the attention kernel the plan assumed

# export
EXPORT = "export"
DOWNLOAD = "download"
EXPORT_CODE = "export-code"

# step-through
PLAY = "play"
STEP_BACK = "step-back"
STEP_NEXT = "step-next"
STEP_RESET = "step-reset"
TICKER = "ticker"  # dcc.Interval driving play
SPEED = "speed"  # steps per tick of play
JUMP_PEAK = "jump-peak"
JUMP_RECOMPUTE = "jump-recompute"
JUMP_TRANSFER = "jump-transfer"  # to the next offload or prefetch
STEP_TEXT = "step-text"
STEP_WHY = "step-why"

# the lesson path (app.lesson)
LESSON = "lesson"  # store: the step shown, or None
LESSON_PENDING = "lesson-pending"  # store: the budget a step set, for the analysis to come
LESSON_VIEW = "lesson-view"  # store: the view the step scrolled to
LESSON_START = "lesson-start"
LESSON_BACK = "lesson-back"
LESSON_NEXT = "lesson-next"
LESSON_REVEAL = "lesson-reveal"
LESSON_TITLE = "lesson-title"
LESSON_QUESTION = "lesson-question"
LESSON_ANSWER = "lesson-answer"

# compare: the plan on screen (A) beside another method or budget (B)
COMPARE_METHOD = "compare-method"
COMPARE_BUDGET = "compare-budget"  # % of the store-all peak
COMPARE_A = "compare-a"
COMPARE_B = "compare-b"
COMPARE_DIFF = "compare-diff"
BATCH_CARD = "batch-card"  # data-for: the analysis the memory-against-batch chart is for
BATCH_FIG = "batch-fig"
BATCH_TEXT = "batch-text"
